"""Where PostgreSQL's time goes per HTTP request: pg_stat_statements around the middleware bench.

``.venv/bin/python -m bench.statements`` runs the payments app of ``workloads/http_middleware.py``
without and with pgonce's middleware (5 s of load each) on the embedded PostgreSQL, with
pg_stat_statements loaded for the run, and prints each statement's calls and execution time per
request. It restarts the embedded server twice (to load the library, and to drop it again
afterwards), so run it alone; it is a tool for finding the next thing to make faster, not a
benchmark with a reference.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import psycopg

import bench.workloads.http_middleware as http
from bench.context import BenchContext
from bench.servers import serve_process
from pgonce.config import Settings
from pgonce.database import embedded_server

SECONDS = 5.0
VARIANTS = ("none", "pgonce")
STATEMENTS = """
SELECT calls, total_exec_time + total_plan_time,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 100)
  FROM pg_stat_statements
 WHERE calls > 100
 ORDER BY total_exec_time + total_plan_time DESC
"""


def _configure(data_dir: Path, preload: bool) -> None:
    with embedded_server(data_dir) as dsn, psycopg.connect(dsn, autocommit=True) as conn:
        if preload:
            conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        else:
            conn.execute("DROP EXTENSION IF EXISTS pg_stat_statements")
            conn.execute("ALTER SYSTEM RESET shared_preload_libraries")


def _measure(dsn: str, variant: str, log: Path) -> None:
    env = {"BENCH_HTTP_VARIANT": variant, "BENCH_HTTP_DSN": dsn}
    with serve_process(http.FACTORY, env, log) as (port, _):
        asyncio.run(http.load(port, 1.0))  # warm-up
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
        requests = len(asyncio.run(http.load(port, SECONDS)).latencies)
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(STATEMENTS).fetchall()
    print(f"\n{variant}: {requests} requests; per request:")
    total = 0.0
    for calls, ms, query in rows:
        total += ms
        print(f"  {calls / requests:5.2f} calls  {ms * 1000 / calls:7.1f} µs each  {query}")
    print(f"  {total * 1000 / requests:.1f} µs of statement time per request")


def main() -> None:
    settings = Settings.from_env()
    data_dir = settings.data_dir
    log = Path(tempfile.gettempdir()) / "pgonce-bench-statements.log"
    _configure(data_dir, preload=True)
    try:
        with embedded_server(data_dir) as dsn:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            ctx = BenchContext(dsn=dsn, schema=settings.schema)
            ctx.prepare()
            http.prepare(ctx)
            try:
                for variant in VARIANTS:
                    _measure(dsn, variant, log)
            finally:
                http.cleanup(ctx)
    finally:
        _configure(data_dir, preload=False)


if __name__ == "__main__":
    main()
