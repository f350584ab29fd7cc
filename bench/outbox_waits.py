"""Where an outbox enqueue's time goes with several clients: what backends wait for, and how long
each statement runs.

``.venv/bin/python -m bench.outbox_waits`` starts a scratch embedded PostgreSQL with
pg_stat_statements loaded and runs the business transactions of the outbox benchmark (insert
alone, the floor, enqueue, enqueue(ordered=False); ``bench/workloads/outbox.py``) on 8
connections, every variant in turn for a few seconds, every other round in the opposite order.
Meanwhile a thread reads pg_stat_activity every few milliseconds: the table says how many of the
backends were, on average, in each state and wait event (a row lock or a transaction's end, a
buffer's content lock at an index's right edge, the WAL flush of a commit, or the client's next
statement: ``idle in transaction:Client:ClientRead``), then pg_stat_statements' mean execution
time of each statement of the transaction, and the server's CPU per transaction (all its
processes, from /proc).

``--pgbench`` sends the same statements from pgbench (C clients, prepared statements) instead of
the benchmark's Python clients, whose own CPU otherwise keeps most backends waiting for their next
statement, where no contention on the server can show. A tool for finding where the time goes, not
a benchmark with a reference: the server is a scratch one, removed at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psycopg

from bench.clients import pgbench_command, run_clients
from bench.database_cost import postmaster, server_cpu
from bench.workloads import outbox
from pgonce.config import DEFAULT_SCHEMA
from pgonce.core.channels import notify_channel
from pgonce.database import embedded_server
from pgonce.sql import Queries
from pgonce.store.migrate import migrate

#: The variants, by their names in the benchmark's table.
VARIANTS = dict(outbox.VARIANTS[:4])
#: How often the sampler reads pg_stat_activity.
SAMPLE_EVERY = 0.003
STATEMENTS = """
SELECT calls, mean_exec_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 80)
  FROM pg_stat_statements
 WHERE calls > 100 AND query NOT LIKE '%pg_stat_activity%'
 ORDER BY total_exec_time DESC
 LIMIT 5
"""
# pgbench's variables: its client number and a random number make each transaction's aggregate.
_AGGREGATE = "(:client_id || '-' || :r)"
_PAYLOAD = "'" + json.dumps(outbox.PAYLOAD) + "'"


def _pgbench_statement(name: str) -> str:
    """The store's statement ``name`` with pgbench variables and literals for its parameters."""
    values = {
        "aggregatetype": "'order'",
        "aggregateid": _AGGREGATE,
        "type": "'order.created'",
        "payload": _PAYLOAD,
        "headers": "NULL",
        "now": "NULL",
        "channel": f"'{notify_channel(DEFAULT_SCHEMA, 'outbox')}'",
    }
    text = getattr(Queries("outbox", DEFAULT_SCHEMA), name).decode()
    text = re.sub(r"%\((\w+)\)s", lambda m: values[m[1]], text)
    # pgbench reads a statement to its semicolon, one line at a time: no comments, one line.
    text = " ".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return " ".join(text.split()) + ";"


def _pgbench_scripts() -> dict[str, str]:
    floor = (
        "INSERT INTO bench.outbox_floor (aggregatetype, aggregateid, type, payload)"
        f" VALUES ('order', {_AGGREGATE}, 'order.created', {_PAYLOAD});"
    )
    outbox_writes = [None, floor, _pgbench_statement("enqueue")]
    outbox_writes.append(_pgbench_statement("enqueue_unordered"))
    scripts = {}
    for name, write in zip(VARIANTS, outbox_writes, strict=True):
        lines = [
            "\\set r random(1, 1000000000000)",
            "BEGIN;",
            f"INSERT INTO bench.outbox_orders (ref, amount) VALUES ({_AGGREGATE}, 4200);",
        ]
        scripts[name] = "\n".join([*lines, *([write] if write else []), "END;"]) + "\n"
    return scripts


def _sample(dsn: str, stop: threading.Event, counts: collections.Counter[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            rows = conn.execute(
                "SELECT state, wait_event_type, wait_event FROM pg_stat_activity"
                " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
                " AND application_name <> 'outbox_waits'"
            ).fetchall()
            for state, kind, event in rows:
                counts[f"{state}:{kind}:{event}"] += 1
            counts["_samples"] += 1
            time.sleep(SAMPLE_EVERY)


def _pgbench_run(dsn: str, script: str, clients: int, seconds: float) -> int:
    """Transactions that pgbench ran."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "script.sql"
        path.write_text(script)
        command = pgbench_command(path, dsn, clients, seconds)
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    found = re.search(r"actually processed: (\d+)", done.stdout)
    assert found is not None, done.stdout
    return int(found[1])


def _python_run(dsn: str, clients: int, seconds: float, name: str) -> int:
    """Transactions that the benchmark's Python clients ran."""
    return run_clients(dsn, clients, seconds, VARIANTS[name]).tx


def _measure(dsn: str, name: str, run: Callable[[], int], seconds: float) -> None:
    with psycopg.connect(dsn, autocommit=True, application_name="outbox_waits") as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
    pm = postmaster(dsn)
    assert pm is not None
    counts: collections.Counter[str] = collections.Counter()
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(dsn, stop, counts))
    cpu = server_cpu(pm)
    sampler.start()
    try:
        tx = max(run(), 1)
    finally:
        stop.set()
        sampler.join()
    cpu = server_cpu(pm) - cpu
    print(f"\n{name}: {tx / seconds:,.0f} tx/s, PostgreSQL CPU {cpu / tx * 1e6:,.0f} µs/tx")
    samples = max(counts.pop("_samples", 0), 1)
    print("  backends (average) in each state:wait_event_type:wait_event")
    for what, seen in counts.most_common():
        print(f"    {seen / samples:5.2f}  {what}")
    with psycopg.connect(dsn, autocommit=True, application_name="outbox_waits") as conn:
        rows = conn.execute(STATEMENTS).fetchall()
    print("  statements: calls per transaction, mean execution time")
    for calls, mean_ms, query in rows:
        print(f"    {calls / tx:4.2f}  {mean_ms * 1000:7.1f} µs  {query}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.outbox_waits", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pgbench", action="store_true", help="C clients instead of Python's")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="pgonce-waits-"))
    base.chmod(0o755)  # the embedded server's own user reaches its data directory through it
    data = base / "data"
    try:
        with (
            embedded_server(data) as dsn,
            psycopg.connect(dsn, autocommit=True) as conn,
        ):
            conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        with embedded_server(data) as dsn:  # started again, with the library loaded
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION pg_stat_statements")
                migrate(conn, DEFAULT_SCHEMA)
            outbox._reset(dsn)
            scripts = _pgbench_scripts()
            names = list(VARIANTS)
            for number in range(args.rounds):
                for name in names if number % 2 == 0 else names[::-1]:
                    run: Callable[[], int]
                    if args.pgbench:
                        run = partial(_pgbench_run, dsn, scripts[name], args.clients, args.seconds)
                    else:
                        run = partial(_python_run, dsn, args.clients, args.seconds, name)
                    _measure(dsn, f"round {number + 1}, {name}", run, args.seconds)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
