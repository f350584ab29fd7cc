"""Flask: the payments app under gunicorn, with pgonce's WSGI middleware and without.

The same Flask app (``bench.flask_app``: POST /payments inserts one row on a psycopg pool
connection and answers 201 with JSON) under one gunicorn (gthread workers), loaded by the HTTP/1.1
client of the ASGI middleware's workload at the same concurrency, each request with a new key:

- ``Flask alone``: the reference; the view's INSERT commits on its own (autocommit);
- ``Flask alone, in a transaction``: BEGIN, INSERT, COMMIT, what the one-transaction design costs
  before any key is claimed;
- ``Flask + pgonce``: ``pgonce.contrib.flask``; the claim, the row and the stored response commit
  in one transaction on the pool's connection.

Rounds are interleaved (each variant first in every other round); each variant's best round is
reported, and the target is also judged on the median over the rounds of the ratio within a round.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.context import BenchContext
from bench.flask_app import SCOPE, TABLE
from bench.pairs import VARIANTS as PAIR
from bench.pairs import alternate, cleanup_payments, compare, gunicorn, prepare_payments
from bench.report import Table

TITLE = "Flask: Idempotency-Key middleware under a WSGI server"

VARIANTS = ("tx", *PAIR)
LABELS = {
    "tx": "Flask alone, in a transaction",
    "none": "Flask alone",
    "pgonce": "Flask + pgonce",
}
CONCURRENCY = 8
WORKERS = 2
THREADS = 4


def run(ctx: BenchContext) -> list[Table]:
    prepare_payments(ctx.dsn, TABLE)
    log = Path(tempfile.gettempdir()) / "pgonce-bench-flask.log"
    log.write_text("")
    rounds = ctx.pick(5, short=3, quick=1)
    seconds = ctx.seconds(5)
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
    in_tx = [r["pgonce"].rps / r["tx"].rps for r in runs if r["tx"].rps > 0]
    notes = [
        f"gunicorn, {WORKERS} gthread workers x {THREADS} threads, a psycopg_pool.ConnectionPool "
        f"of {THREADS} connections per worker; {CONCURRENCY} keep-alive client connections, a "
        f"new key on every request; {rounds} interleaved round(s) of {seconds:g} s, each "
        "variant's best round. Server CPU is gunicorn's master and workers; PostgreSQL CPU its "
        "backends and background processes, both per request over the measured round.",
        "Flask + pgonce does more per request than Flask alone: BEGIN, the claim, the row, the "
        "stored response and COMMIT in one transaction (three round trips), against an "
        "autocommit INSERT. Against the app alone in a transaction (the same transaction, no "
        f"key), median round: {100 * statistics.median(in_tx):.0f} %.",
    ]
    return compare(TITLE, LABELS, runs, probes, notes)
