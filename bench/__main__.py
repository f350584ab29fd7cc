"""Run the benchmark workloads and write ``bench/results/latest.md``.

A workload is a module in ``bench/workloads/`` with ``TITLE`` and ``run(ctx) -> list[Table]``.
``python -m bench --only keys`` runs the workloads whose module name contains ``keys``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.context import BenchContext
from bench.report import Table
from pgonce.config import Settings
from pgonce.database import open_database

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(prog="make bench", description=__doc__)
    parser.add_argument("--only", help="run only workloads whose name contains this")
    parser.add_argument("--quick", action="store_true", help="short runs, for a smoke test")
    args = parser.parse_args()

    names = [m.name for m in pkgutil.iter_modules([str(Path(__file__).parent / "workloads")])]
    chosen = [n for n in sorted(names) if not args.only or args.only in n]
    if not chosen:
        print(f"no workload matches {args.only!r}; there are: {', '.join(names)}", file=sys.stderr)
        return 2
    settings = Settings.from_env(dsn=os.environ.get("PGONCE_BENCH_DSN"))
    tables: list[Table] = []
    with open_database(settings) as db, contextlib.ExitStack():
        print(f"bench: using {db.description}", file=sys.stderr)
        ctx = BenchContext(dsn=db.dsn, schema=settings.schema, quick=args.quick)
        ctx.prepare()
        for name in chosen:
            module = importlib.import_module(f"bench.workloads.{name}")
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            tables.extend(module.run(ctx))
            print(f"bench: {name} took {time.perf_counter() - started:.0f} s", file=sys.stderr)
    header = [
        "# pgonce benchmarks",
        "",
        f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, {db.description}"
        f"{' (quick run)' if args.quick else ''}. Client and server share the machine.",
        "Every figure stands next to a reference measured in the same run.",
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    text = "\n".join(header) + "\n".join(t.markdown() for t in tables)
    # Only a full run is "latest"; a partial one must not overwrite the other workloads' figures.
    name = "latest.md" if not args.only and not args.quick else f"partial-{args.only or 'all'}.md"
    (RESULTS / name).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
