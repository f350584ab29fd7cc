"""What the Django, Flask and FastAPI + SQLAlchemy apps run per request, with pgonce and without,
counted in instructions.

``.venv/bin/python -m bench.adapter_instructions DSN`` (a database pgonce migrated; it is migrated
here if it is not) runs each variant below in a process of its own under ``valgrind
--tool=callgrind``, twice: 200 and then 1,200 requests, and prints the difference of the two
processes' instruction counts over 1,000: what one request costs. Start-up, imports, Django's
set-up and the warm-up cancel out. Each process builds its app exactly as the Django, Flask and
SQLAlchemy benchmarks do (``bench.django_app.create_app()``, ``bench.flask_app.create_app()`` on
one connection, ``bench.workloads.sqlalchemy_middleware.create_app()``) and drives it IN-PROCESS,
one request after the other: a WSGI app through its callable, its environ as gunicorn builds one;
the ASGI app through its callable on uvloop, its scope as uvicorn builds one. No server and no
sockets but the database's; each request a POST /payments with a new Idempotency-Key. The
variants:

- ``django: alone``, ``django: ATOMIC_REQUESTS``, ``django: pgonce``, ``django: statements``
  (the key store's statements alone, ``bench.django_app.StatementsAlone``), ``django: by hand``;
- ``flask: alone``, ``flask: pgonce``, ``flask: statements`` (the key store's statements alone,
  ``bench.flask_app.StatementsAlone``), ``flask: by hand``;
- ``sqlalchemy: alone``, ``sqlalchemy: pgonce``, ``sqlalchemy: statements`` (FastAPI on an
  ``AsyncEngine``; the key store's statements alone around the same endpoint and session);
- ``fastapi: alone``, ``fastapi: pgonce``, ``fastapi: statements``: the HTTP middleware
  benchmark's app (``bench.workloads.http_middleware.create_app()``, a psycopg pool) in the
  shape its database-cost target measures, the endpoint taking its connection through a FastAPI
  dependency: without the middleware, with pgonce's, and with the key store's statements alone.

Under gunicorn the server's own share (parsing, the socket) is added to each, and the timings on
the shared 2-core machine move by a fifth from run to run; these counts repeat to a few thousand
instructions (a quarter of a percent: how often the client polls for the server's answer varies
with the machine's load), so they show what a change to an adapter saves on any day. Needs
valgrind; a few minutes a variant.

``--only TEXT`` measures the variants whose name contains TEXT. ``--profile`` runs cProfile on
the pgonce variants instead (``--only`` applies; ``--count`` requests each, no valgrind) and
prints the functions with the most own time; ``--callgrind DIR`` keeps each long run's callgrind
output there (``--dump-instr=no``, for ``callgrind_annotate``). ``--variant NAME --count N`` runs
one variant in this process (what each measured process does).
"""

from __future__ import annotations

import asyncio
import atexit
import cProfile
import io
import os
import pstats
import re
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import uvloop

from bench import django_app, flask_app
from bench.callgrind import instructions, parser, require_valgrind
from bench.pairs import prepare_payments
from bench.workloads import http_middleware, sqlalchemy_middleware
from pgonce.store.migrate import migrate

SHORT, LONG = 200, 1200
WARM_UP = 20

#: Variant name -> (app, its BENCH_*_VARIANT).
VARIANTS = {
    "django: alone": ("django", "none"),
    "django: ATOMIC_REQUESTS": ("django", "atomic"),
    "django: pgonce": ("django", "pgonce"),
    "django: statements": ("django", "statements"),
    "django: by hand": ("django", "hand"),
    "flask: alone": ("flask", "none"),
    "flask: pgonce": ("flask", "pgonce"),
    "flask: statements": ("flask", "statements"),
    "flask: by hand": ("flask", "hand"),
    "sqlalchemy: alone": ("sqlalchemy", "none"),
    "sqlalchemy: pgonce": ("sqlalchemy", "pgonce"),
    "sqlalchemy: statements": ("sqlalchemy", "statements"),
    "fastapi: alone": ("fastapi", "none-dependency"),
    "fastapi: pgonce": ("fastapi", "pgonce"),
    "fastapi: statements": ("fastapi", "pgonce-floor-dependency"),
}

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
ASGIApp = Callable[..., Awaitable[None]]


def main() -> None:
    cli = parser("bench.adapter_instructions", __doc__, VARIANTS, LONG)
    cli.add_argument("--profile", action="store_true", help="cProfile the pgonce variants")
    cli.add_argument("--callgrind", type=Path, help="keep the long runs' callgrind output here")
    args = cli.parse_args()
    if args.variant is not None:
        _run(args.dsn, args.variant, args.count, profile=args.profile)
        return
    _prepare(args.dsn)
    chosen = [v for v in VARIANTS if not args.only or args.only in v]
    if args.profile:
        for variant in chosen:
            if VARIANTS[variant][1].startswith("pgonce"):
                print(f"## {variant}, {args.count} requests", flush=True)
                command = [sys.executable, "-m", "bench.adapter_instructions", args.dsn]
                command += ["--variant", variant, "--count", str(args.count), "--profile"]
                subprocess.run(command, check=True)
        return
    require_valgrind("bench.adapter_instructions")
    print("| variant | instructions per request |\n|---|---|")
    for variant in chosen:
        keep: dict[int, Path | None] = {LONG: None, SHORT: None}
        if args.callgrind is not None:
            args.callgrind.mkdir(parents=True, exist_ok=True)
            name = variant.replace(": ", "-").replace(" ", "_")
            keep = {n: args.callgrind / f"callgrind.{name}.{n}" for n in keep}
        # The two processes side by side: their counts do not depend on the timing.
        with ThreadPoolExecutor(2) as pool:
            long_run = pool.submit(
                instructions, "bench.adapter_instructions", args.dsn, variant, LONG, keep[LONG]
            )
            short = instructions(
                "bench.adapter_instructions", args.dsn, variant, SHORT, keep[SHORT]
            )
            long = long_run.result()
        print(f"| {variant} | {(long - short) / (LONG - SHORT):,.0f} |", flush=True)
    if args.callgrind is not None:
        for variant in chosen:
            name = variant.replace(": ", "-").replace(" ", "_")
            print(f"\n{variant}: the C functions' own instructions per request (the most)")
            files = (args.callgrind / f"callgrind.{name}.{n}" for n in (LONG, SHORT))
            for function, count in _by_function(*files)[:30]:
                print(f"{count:>10,.0f}  {function}")


def _prepare(dsn: str) -> None:
    """pgonce's schema and both apps' empty payments tables."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, "pgonce")
    prepare_payments(dsn, django_app.TABLE)
    prepare_payments(dsn, flask_app.TABLE)
    prepare_payments(dsn, sqlalchemy_middleware.TABLE)
    prepare_payments(dsn, http_middleware.TABLE)


def _by_function(long: Path, short: Path) -> list[tuple[str, float]]:
    """Each function's own instructions per request (``callgrind_annotate`` of the long and the
    short run, the difference over the requests between them), the most first."""

    def own(out: Path) -> dict[str, int]:
        text = subprocess.run(
            ["callgrind_annotate", "--threshold=100", str(out)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        counts: dict[str, int] = {}
        for line in text.splitlines():
            match = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(\S.*?)(?: \[.*\])?$", line)
            if match and "PROGRAM TOTALS" not in line:
                name = match[2].rsplit("/", 1)[-1]
                counts[name] = counts.get(name, 0) + int(match[1].replace(",", ""))
        return counts

    many, few = own(long), own(short)
    per = {f: (n - few.get(f, 0)) / (LONG - SHORT) for f, n in many.items()}
    return sorted(per.items(), key=lambda item: -item[1])


def _app(dsn: str, variant: str) -> WSGIApp:
    """The benchmark's app for ``variant``, built by its own factory, on one connection."""
    framework, setting = VARIANTS[variant]
    os.environ["BENCH_HTTP_DSN"] = dsn
    if framework == "django":
        os.environ["BENCH_DJANGO_VARIANT"] = setting
        app: WSGIApp = django_app.create_app()
        return app
    os.environ["BENCH_FLASK_VARIANT"] = setting
    os.environ["BENCH_FLASK_THREADS"] = "1"
    return flask_app.create_app()


def _environ(key: str, body: bytes) -> dict[str, Any]:
    """A POST /payments as gunicorn's gthread worker hands it to the app."""
    return {
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "",
        "PATH_INFO": "/payments",
        "QUERY_STRING": "",
        "RAW_URI": "/payments",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "8000",
        "REMOTE_ADDR": "127.0.0.1",
        "REMOTE_PORT": "50000",
        "HTTP_HOST": "127.0.0.1:8000",
        "HTTP_AUTHORIZATION": "Bearer bench",
        "HTTP_IDEMPOTENCY_KEY": key,
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        "wsgi.input_terminated": True,
        "wsgi.file_wrapper": None,
    }


def _run(dsn: str, variant: str, count: int, *, profile: bool = False) -> None:
    run = uuid.uuid4().hex[:12]  # the keys of this process, new to the key store
    if VARIANTS[variant][0] in ("sqlalchemy", "fastapi"):
        requests = _asgi_requests(_asgi_app(dsn, variant), run, variant)
    else:
        requests = _wsgi_requests(_app(dsn, variant), run, variant)
    requests(-WARM_UP, 0)
    if not profile:
        requests(0, count)
        return
    profiler = cProfile.Profile()
    profiler.runcall(requests, 0, count)
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)


def _body(seq: int) -> bytes:
    return b'{"amount": %d, "currency": "EUR"}' % (1000 + seq % 9000)


def _wsgi_requests(app: WSGIApp, run: str, variant: str) -> Callable[[int, int], None]:
    statuses: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        statuses.append(status)
        return None

    def requests(first: int, last: int) -> None:
        for seq in range(first, last):
            result = app(_environ(f"{run}-{seq:08d}", _body(seq)), start_response)
            try:
                b"".join(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            if not statuses[-1].startswith("201"):
                raise RuntimeError(f"{variant} answered {statuses[-1]}")

    return requests


def _asgi_app(dsn: str, variant: str) -> ASGIApp:
    framework, setting = VARIANTS[variant]
    os.environ["BENCH_HTTP_DSN"] = dsn
    if framework == "fastapi":
        os.environ["BENCH_HTTP_VARIANT"] = setting
        app: ASGIApp = http_middleware.create_app()
        return app
    os.environ["BENCH_SQLALCHEMY_VARIANT"] = setting
    return sqlalchemy_middleware.create_app()


def _asgi_requests(app: ASGIApp, run: str, variant: str) -> Callable[[int, int], None]:
    loop = uvloop.new_event_loop()
    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def request(seq: int) -> None:
        body = _body(seq)
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.Future()  # the client stays connected until the answer is out
            raise AssertionError("unreachable")

        await app(_scope(f"{run}-{seq:08d}", body), receive, send)
        if statuses[-1] != 201:
            raise RuntimeError(f"{variant} answered {statuses[-1]}")

    async def serially(first: int, last: int) -> None:
        for seq in range(first, last):
            await request(seq)

    def requests(first: int, last: int) -> None:
        loop.run_until_complete(serially(first, last))

    # The app's lifespan (the HTTP benchmark's opens its pool there), for the whole process.
    lifespan = getattr(getattr(app, "router", None), "lifespan_context", None)
    if lifespan is not None:
        running = lifespan(app)
        loop.run_until_complete(running.__aenter__())
        atexit.register(lambda: loop.run_until_complete(running.__aexit__(None, None, None)))
    return requests


def _scope(key: str, body: bytes) -> dict[str, Any]:
    """A POST /payments as uvicorn hands it to the app."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
        "method": "POST",
        "root_path": "",
        "path": "/payments",
        "raw_path": b"/payments",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"authorization", b"Bearer bench"),
            (b"idempotency-key", key.encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "state": {},
    }


if __name__ == "__main__":
    main()
