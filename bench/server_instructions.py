"""What the HTTP server runs per request in each middleware variant, counted rather than timed.

``.venv/bin/python -m bench.server_instructions`` serves each variant of the payments app
(``workloads/http_middleware.py``) under ``valgrind --tool=cachegrind``, sends it 100 and then,
from a second server, 600 new-key requests, and prints the difference of the two servers'
instruction counts over 500: what one request costs the server process (uvicorn, FastAPI, the
middleware, psycopg; the kernel's share of the system calls is not counted). Timings on the shared
2-core machine move by a fifth from one run to the next (the middleware bench's floor measured 86
to 106 % of the bare endpoint on one day); these counts repeat to about half a percent, so they
show what a change to the middleware saves. PostgreSQL is the embedded one, or
``PGONCE_BENCH_DSN``'s. Needs valgrind; about a minute a variant.

``--connections 8`` drives each server as the bench does (the counts then include the event
loop's batching, and move by about one percent); the default, one connection, repeats best.
A tool for finding the next thing to make cheaper, not a benchmark with a reference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bench.workloads.http_middleware as http
from bench.context import BenchContext
from bench.servers import serve_process
from pgonce.config import Settings
from pgonce.database import open_database

WARM_UP = 50  # requests before the counted ones: the pool's connections, prepared statements
FEW, MANY = 100, 600
VALGRIND = ("valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null")
DEFAULT_VARIANTS = ("none", "pgonce-floor", "pgonce-request", "pgonce", "none-dependency")


def _count(dsn: str, variant: str, requests: int, connections: int, log: Path) -> int:
    """Instructions of one server process that answered ``WARM_UP + requests`` requests."""
    log.write_text("")
    env = {"BENCH_HTTP_VARIANT": variant, "BENCH_HTTP_DSN": dsn}
    with serve_process(http.FACTORY, env, log, ready=300, wrapper=VALGRIND, stop=300) as (port, _):
        result = asyncio.run(http.load(port, 3600, connections, count=WARM_UP + requests))
    if set(result.statuses) != {201}:
        raise RuntimeError(f"{variant} answered {result.statuses}; see {log}")
    counted = re.findall(r"I\s+refs:\s+([\d,]+)", log.read_text())
    if not counted:
        raise RuntimeError(f"valgrind reported no count for {variant}; see {log}")
    return int(counted[-1].replace(",", ""))


def _per_request(dsn: str, variant: str, connections: int, logs: Path) -> float:
    """Instructions a request: two servers, FEW and MANY requests, side by side (their counts do
    not depend on the timing)."""
    with ThreadPoolExecutor(2) as pool:
        few, many = (
            pool.submit(_count, dsn, variant, n, connections, logs / f"pgonce-vg-{n}.log")
            for n in (FEW, MANY)
        )
        return (many.result() - few.result()) / (MANY - FEW)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.server_instructions", description=__doc__
    )
    parser.add_argument("--connections", type=int, default=1, help="concurrent connections")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, of: {', '.join(http.VARIANTS)}",
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in http.VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}")
    if shutil.which("valgrind") is None:
        print("needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    settings = Settings.from_env(dsn=os.environ.get("PGONCE_BENCH_DSN"))
    logs = Path(tempfile.gettempdir())
    with open_database(settings) as db:
        ctx = BenchContext(dsn=db.dsn, schema=settings.schema)
        ctx.prepare()
        http.prepare(ctx)
        try:
            reference: float | None = None
            for variant in variants:
                per_request = _per_request(db.dsn, variant, args.connections, logs)
                reference = reference or per_request
                print(
                    f"{http.LABELS[variant]:<58} {per_request:>12,.0f} instructions a request"
                    f"  ({per_request / reference:.1%} of {http.LABELS[variants[0]]})",
                    flush=True,
                )
        finally:
            http.cleanup(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
