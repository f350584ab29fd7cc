"""Flask: the payments app under gunicorn, with pgonce's WSGI middleware and without.

The same Flask app (``bench.flask_app``: POST /payments inserts one row on a psycopg pool
connection and answers 201 with JSON) under gunicorn (gthread workers), loaded by the HTTP/1.1
client of the ASGI middleware's workload at the same concurrency, each request with a new key:

- ``Flask alone``: the reference, the app as a Flask app writes through a psycopg pool created
  with psycopg's defaults (as the how-to creates it): ``with pool.connection()`` opens a
  transaction at the INSERT and commits it at the block's end (BEGIN, INSERT, COMMIT);
- ``Flask alone, autocommit pool``: the same app on a pool of autocommit connections, its INSERT
  outside any transaction: the cheapest write there is, shown beside the reference;
- ``Flask + pgonce``: ``pgonce.contrib.flask`` on the reference's pool; the claim, the row and
  the stored response commit in one transaction on the pool's connection;
- ``Flask alone + a key by hand``: the reference writing pgonce's key row and response itself in
  the same round trips (``bench.by_hand``), none of pgonce's code;
- ``the key store's statements alone``: the reference between the key store's begin() and
  commit(), none of the middleware's logic (``bench.flask_app.StatementsAlone``): what the
  claim and the stored response cost the app with the least Python around them, the limit of
  the target for any WSGI middleware on the one-transaction design.

The target compares the app with pgonce and without it on the same pool, with the same
connection settings; the ratio to the autocommit pool, which has no transaction at all, is
stated beside it.

Every variant's servers run throughout; in each round the variants take turns of half a second
(every other turn in the opposite order), so that a drift of the shared machine lands on all of
them alike. Each variant's best round is reported, and the target is also judged on the median over
the rounds of the ratio within a round.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.context import BenchContext
from bench.flask_app import SCOPE, TABLE
from bench.pairs import (
    LIMIT,
    STATEMENTS,
    STATEMENTS_LABEL,
    alternate,
    cleanup_payments,
    compare,
    design_limit,
    gunicorn,
    prepare_payments,
    served,
)
from bench.pairs import VARIANTS as PAIR
from bench.report import Table, statements_alone
from bench.workloads.http_middleware import paired

TITLE = "Flask: Idempotency-Key middleware under a WSGI server"

VARIANTS = ("autocommit", *PAIR, STATEMENTS, LIMIT)
LABELS = {
    "autocommit": "Flask alone, autocommit pool",
    "none": "Flask alone",
    "pgonce": "Flask + pgonce",
    STATEMENTS: STATEMENTS_LABEL,
    LIMIT: "Flask alone + a key by hand",
}
CONCURRENCY = 8
WORKERS = 2
THREADS = 4


def run(ctx: BenchContext) -> list[Table]:
    prepare_payments(ctx.dsn, TABLE)
    log = Path(tempfile.gettempdir()) / "pgonce-bench-flask.log"
    log.write_text("")
    rounds = ctx.pick(5, short=5, quick=1)
    seconds = ctx.pick(5.0, short=4.0, quick=1.0)
    runs, probes = alternate(
        VARIANTS,
        lambda variant: gunicorn(
            "bench.flask_app:create_app()",
            {
                "BENCH_FLASK_VARIANT": variant,
                "BENCH_FLASK_THREADS": str(THREADS),
                "BENCH_HTTP_DSN": ctx.dsn,
            },
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
    autocommit = paired(runs, "pgonce", "autocommit") or 0.0
    notes = [
        f"{served(WORKERS, THREADS, CONCURRENCY, rounds, seconds)} A "
        f"psycopg_pool.ConnectionPool of {THREADS} connections per worker. "
        "Server CPU is gunicorn's masters and workers; PostgreSQL CPU its "
        "backends and background processes, both per request over the measured round.",
        "Every variant's pool is created with psycopg's default connection settings but the "
        "autocommit pool's. Flask alone runs BEGIN, the INSERT and COMMIT (three round trips); "
        "Flask + pgonce runs BEGIN and the claim, the INSERT, the stored response and COMMIT "
        "(three round trips, and the key's row). Against the autocommit pool (one round trip, "
        f"no transaction), median round: {100 * autocommit:.0f} %.",
    ]
    tables = compare(TITLE, LABELS, runs, probes, notes)
    tables[0].notes.append(
        statements_alone(
            "a WSGI middleware",
            "the app between the key store's begin() and commit(), the view writing on the "
            "claim's connection as under Flask + pgonce",
            "Flask alone",
            "Flask + pgonce",
        )
    )
    tables[1].notes.append(design_limit(LABELS, runs))
    return tables
