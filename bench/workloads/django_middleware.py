"""Django: the payments app under gunicorn, with pgonce's Idempotency-Key middleware and without.

The same Django app (``bench.django_app``: POST /payments inserts one row with the ORM and answers
201 with JSON) under gunicorn (gthread workers, persistent connections), loaded by the
HTTP/1.1 client of the ASGI middleware's workload at the same concurrency, each request with a new
key:

- ``Django alone``: the reference; the view's INSERT commits on its own (autocommit);
- ``Django alone, ATOMIC_REQUESTS``: the view in a transaction (BEGIN, INSERT, COMMIT), what the
  one-transaction design costs before any key is claimed;
- ``Django + pgonce``: ``pgonce.contrib.django``'s middleware; the claim, the row and the stored
  response commit in one transaction on Django's connection;
- ``the key store's statements alone``: the view between the key store's begin() and commit() in
  an ``atomic()`` block, with none of the middleware's logic (``bench.django_app.StatementsAlone``);
- ``Django alone + a key by hand``: the view writing pgonce's key row and response itself in its
  own ``atomic()`` block, in the same round trips (``bench.by_hand``), none of pgonce's code.

The target has two limits, both measured: ``ATOMIC_REQUESTS``, since no adapter that commits the
key with the view's writes does better than the view's own transaction; and the key store's
statements alone, which add the claim and the stored response to that transaction with the least
Python around them.

Every variant's servers run throughout; in each round the variants take turns of half a second
(every other turn in the opposite order), so that a drift of the shared machine lands on all of
them alike. Each variant's best round is reported, and the target is also judged on the median over
the rounds of the ratio within a round.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.context import BenchContext
from bench.django_app import SCOPE, TABLE
from bench.pairs import (
    LIMIT,
    STATEMENTS,
    STATEMENTS_LABEL,
    alternate,
    cleanup_payments,
    compare,
    design_limit,
    gunicorn,
    limit_note,
    prepare_payments,
    served,
)
from bench.pairs import VARIANTS as PAIR
from bench.report import Table, statements_alone

TITLE = "Django: Idempotency-Key middleware under a WSGI server"

#: The pair every adapter's workload compares, and the app in a transaction of its own beside them.
VARIANTS = ("atomic", *PAIR, STATEMENTS, LIMIT)
LABELS = {
    "atomic": "Django alone, ATOMIC_REQUESTS",
    "none": "Django alone",
    "pgonce": "Django + pgonce",
    STATEMENTS: STATEMENTS_LABEL,
    LIMIT: "Django alone + a key by hand",
}
CONCURRENCY = 8
WORKERS = 2
THREADS = 4


def run(ctx: BenchContext) -> list[Table]:
    prepare_payments(ctx.dsn, TABLE)
    log = Path(tempfile.gettempdir()) / "pgonce-bench-django.log"
    log.write_text("")
    rounds = 1 if ctx.quick else 5
    seconds = ctx.pick(5.0, short=4.0, quick=1.0)
    runs, probes = alternate(
        VARIANTS,
        lambda variant: gunicorn(
            "bench.django_app:create_app()",
            {"BENCH_DJANGO_VARIANT": variant, "BENCH_HTTP_DSN": ctx.dsn},
            log,
            workers=WORKERS,
            threads=THREADS,
        ),
        ctx.dsn,
        rounds=rounds,
        seconds=seconds,
        concurrency=CONCURRENCY,
    )
    cleanup_payments(ctx.dsn, ctx.schema, SCOPE, TABLE)
    notes = [
        f"{served(WORKERS, THREADS, CONCURRENCY, rounds, seconds)} Persistent database "
        "connections (CONN_MAX_AGE=None). "
        "Server CPU is gunicorn's masters and workers; PostgreSQL CPU its backends and "
        "background processes, both per request over the measured round.",
        "Round trips per request (libpq's trace of one request): Django alone 1, an autocommit "
        "INSERT; ATOMIC_REQUESTS 3, BEGIN, the INSERT and COMMIT each alone; Django + pgonce 3, "
        "BEGIN with the claim, the INSERT, the stored response with COMMIT, in one transaction; "
        "the key store's statements alone the same 3.",
        statements_alone(
            "a Django middleware",
            "the view between the key store's begin() and commit() in an atomic() block on "
            "Django's connection, as Django + pgonce does",
            "ATOMIC_REQUESTS",
            "Django + pgonce",
        ),
    ]
    tables = compare(TITLE, LABELS, runs, probes, notes)
    # The target's other limit: the view in the transaction the guarantee needs, with no key.
    tables[-1].notes.append(
        limit_note(
            LABELS,
            runs,
            "atomic",
            f"The guarantee's own limit: {LABELS['atomic']} (the view in a transaction, the one "
            "pgonce's claim and stored response join, and no key)",
            ": no adapter that commits the key with the view's writes does better than the "
            "view's own transaction",
        )
    )
    tables[-1].notes.append(design_limit(LABELS, runs, "add to that transaction"))
    return tables
