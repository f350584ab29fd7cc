"""What the Django benchmark's variants send to PostgreSQL for one request, from libpq's trace.

``.venv/bin/python -m bench.django_round_trips DSN`` (a database pgonce migrated) runs the app of
``workloads/django_middleware.py`` (``bench.django_app``) in one process per variant, serves a few
requests through its WSGI application in that process (no HTTP server: only the database side
counts here), traces the next one with ``pgconn.trace()`` and prints what the client sent: each
statement, and the exchanges: the runs of messages the client sent with no answer read in
between. A batch pgonce sends (libpq's pipeline, one Sync) and a simple-protocol Query are each
one exchange and one round trip; psycopg's pipeline reads whatever answers arrived while it
sends, so an exchange it opens may not be a wait (the by-hand variant, which sends BEGIN and its
claim in one psycopg pipeline, shows more exchanges than it waits for answers). It creates and
empties the payments table, as the benchmark does. Counts, not timings: they repeat exactly.

``--variant NAME`` runs one variant in this process (what each child does).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import uuid
from typing import Any

from bench.pairs import prepare_payments

VARIANTS = ("none", "atomic", "pgonce", "statements", "hand")
WARM = 3
BODY = json.dumps({"amount": 5, "currency": "EUR"}).encode()


def _request(app: Any) -> None:
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/payments",
        "QUERY_STRING": "",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(BODY),
        "CONTENT_LENGTH": str(len(BODY)),
        "CONTENT_TYPE": "application/json",
        "HTTP_IDEMPOTENCY_KEY": uuid.uuid4().hex,
    }
    statuses: list[str] = []
    answer = app(environ, lambda status, headers: statuses.append(status))
    b"".join(answer)
    answer.close()
    if not statuses or not statuses[0].startswith("201"):
        raise RuntimeError(f"the app answered {statuses}")


def trace(variant: str, dsn: str) -> list[str]:
    """What the client sent for one request of ``variant``: one line per message that matters."""
    os.environ["BENCH_DJANGO_VARIANT"] = variant
    os.environ["BENCH_HTTP_DSN"] = dsn
    from bench.django_app import create_app

    app = create_app()
    for _ in range(WARM):  # connect, prepare pgonce's statements
        _request(app)
    from django.db import connection

    with tempfile.TemporaryFile("w+") as out:
        pgconn = connection.connection.pgconn
        pgconn.trace(out.fileno())
        try:
            _request(app)
        finally:
            pgconn.untrace()
        out.seek(0)
        lines = out.read().splitlines()
    sent = []
    answered = True  # the first message the client sends opens a round trip
    for line in lines:
        fields = line.split("\t")
        if len(fields) < 4:
            continue
        if fields[1] != "F":
            answered = True
            continue
        if answered:
            sent.append(TRIP)
            answered = False
        message, rest = fields[3], " ".join(fields[4:]).split()
        if message in ("Query", "Parse"):
            sent.append(f"{message}: {' '.join(rest)[:90]}")
        elif message == "Bind":
            sent.append(f"Bind: {rest[1] if len(rest) > 1 else ''}")
        elif message in ("Sync", "Flush"):
            sent.append(message)
    return sent


#: The line that starts each exchange in what :func:`trace` returns.
TRIP = "--"


def exchanges(sent: list[str]) -> int:
    """The runs of messages the client sent before reading an answer."""
    return sent.count(TRIP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dsn")
    parser.add_argument("--variant", choices=VARIANTS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(trace(args.variant, args.dsn)))
        return
    prepare_payments(args.dsn, "bench_django_payments")
    for variant in VARIANTS:
        command = [sys.executable, "-m", "bench.django_round_trips", args.dsn]
        child = subprocess.run(
            [*command, "--variant", variant], capture_output=True, text=True, check=True
        )
        sent: list[str] = json.loads(child.stdout.splitlines()[-1])
        print(f"{variant}: {exchanges(sent)} exchange(s)")
        for line in sent:
            print(f"    {line}")


if __name__ == "__main__":
    main()
