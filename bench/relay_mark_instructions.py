"""What the relay's publish mark costs PostgreSQL per event, counted in instructions.

``.venv/bin/python -m bench.relay_mark_instructions`` marks batches of 50 pending events, each of
its own aggregate, published as the relay does after the broker's acknowledgement (one
``mark_published`` per transaction), on a scratch cluster under ``valgrind --tool=callgrind``
(see :mod:`bench.instructions`): the server's instructions per event. The relay's statements run
inside its transaction, between the broker's answers, so what they cost bounds its throughput as
surely as the broker does; a change that moves work from the business transaction into the relay
is weighed with this beside ``bench.outbox_instructions``. Needs valgrind; takes a few minutes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from functools import partial
from itertools import count
from pathlib import Path

import psycopg

from bench.instructions import LONG, SHORT, _backend, _bindir, _server
from pgonce.config import DEFAULT_SCHEMA
from pgonce.store._sync.outbox import OutboxStore
from pgonce.store.migrate import migrate

BATCH = 50

FILL = """
INSERT INTO pgonce.outbox (aggregatetype, aggregateid, type, payload)
SELECT 'order', g::text, 'order.created', '{"n": 1}' FROM generate_series(1, %(rows)s) AS g;
INSERT INTO pgonce.outbox_aggregates (aggregatetype, aggregateid, events, last_enqueued_at)
SELECT 'order', g::text, 1, now() FROM generate_series(1, %(rows)s) AS g;
"""


def _mark(dsn: str, batches: count[int], transactions: int) -> None:
    """Mark the next ``transactions`` batches published, one transaction each."""
    store = OutboxStore()
    # Prepared from the first execution, as the relay's connection is after its first batch.
    with psycopg.connect(dsn, prepare_threshold=0) as conn:
        for _ in range(transactions):
            first = next(batches) * BATCH + 1
            with conn.transaction():
                store.mark_published(conn, list(range(first, first + BATCH)))


def main() -> None:
    argparse.ArgumentParser(
        prog="python -m bench.relay_mark_instructions", description=__doc__.split("\n\n")[0]
    ).parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("bench.relay_mark_instructions needs valgrind (apt-get install valgrind)")
    batches = count()
    with (
        tempfile.TemporaryDirectory(prefix="pgonce-instructions-") as tmp,
        _server(_bindir(), Path(tmp)) as (dsn, counts),
    ):
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn, DEFAULT_SCHEMA)
            # Ids 1, 2, ... in order: a fresh cluster's identity starts at 1.
            for statement in FILL.strip().split(";\n"):
                conn.execute(statement.encode(), {"rows": (LONG + SHORT + 2) * BATCH})
            conn.execute("VACUUM ANALYZE pgonce.outbox")
            conn.execute("VACUUM ANALYZE pgonce.outbox_aggregates")
        _backend(counts, lambda _: psycopg.connect(dsn).close(), 0, 1)
        _mark(dsn, batches, 1)  # unreported, as bench.outbox_instructions does
        long = _backend(counts, partial(_mark, dsn, batches), LONG, 1)
        short = _backend(counts, partial(_mark, dsn, batches), SHORT, 1)
        per_batch = (long - short) / (LONG - SHORT)
        print("| statement | server instructions per event |\n|---|---|")
        print(
            f"| mark_published, {BATCH} events of {BATCH} aggregates | {per_batch / BATCH:,.0f} |"
        )


if __name__ == "__main__":
    main()
