"""Run the benchmark workloads and write ``bench/results/latest.md``.

A workload is a module in ``bench/workloads/`` with ``TITLE`` and ``run(ctx) -> list[Table]``.
``python -m bench --only keys`` runs the workloads whose module name contains ``keys``.

Only a run of every workload writes ``latest.md``, in one piece, headed by the commit it ran
(and whether the tree had uncommitted changes), the date, the machine, the PostgreSQL version
and the profile; ``--only`` and ``--quick`` write ``partial-<name>.md`` beside it. Nothing in a
report is written by hand: a figure that is not in this run is not in the report.

    python -m bench                      # the standard profile (about 45 minutes on 2 cores)
    python -m bench --profile short      # every workload, shorter measurements, fewer rounds
    python -m bench --quick              # a smoke test; writes partial-quick.md

The report's header gives the time each workload took, and the whole run's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import shlex
import sys
import time
from pathlib import Path

import psycopg

from bench.context import PROFILES, BenchContext
from bench.report import Table
from pgonce.config import Settings
from pgonce.database import open_database
from tools.provenance import header, write

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="make bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="run only workloads whose name contains this")
    parser.add_argument(
        "--profile",
        choices=[p for p in PROFILES if p != "quick"],
        default="standard",
        help="; ".join(f"{name}: {what}" for name, what in PROFILES.items() if name != "quick"),
    )
    parser.add_argument("--quick", action="store_true", help=PROFILES["quick"])
    args = parser.parse_args()
    profile = "quick" if args.quick else args.profile

    names = [m.name for m in pkgutil.iter_modules([str(Path(__file__).parent / "workloads")])]
    chosen = [n for n in sorted(names) if not args.only or args.only in n]
    if not chosen:
        print(f"no workload matches {args.only!r}; there are: {', '.join(names)}", file=sys.stderr)
        return 2
    settings = Settings.from_env(dsn=os.environ.get("PGONCE_BENCH_DSN"))
    tables: list[Table] = []
    took: dict[str, float] = {}
    with open_database(settings) as db, contextlib.ExitStack():
        print(f"bench: using {db.description}", file=sys.stderr)
        ctx = BenchContext(dsn=db.dsn, schema=settings.schema, profile=profile)
        postgres = _version(db.dsn)
        ctx.prepare()
        for name in chosen:
            module = importlib.import_module(f"bench.workloads.{name}")
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            tables.extend(module.run(ctx))
            took[name] = time.perf_counter() - started
            print(f"bench: {name} took {took[name]:.0f} s", file=sys.stderr)
    command = "make bench" + (f' BENCH_ARGS="{shlex.join(sys.argv[1:])}"' if sys.argv[1:] else "")
    head = header(
        "pgonce benchmarks",
        command=command,
        postgres=f"{postgres} ({db.description})",
        profile=f"{profile} ({PROFILES[profile]})"
        + ("" if not args.only else f", only {', '.join(chosen)}"),
    )
    intro = [
        "Client and server share the machine. Every figure stands next to a reference measured "
        "in the same run.",
        "",
        "Time per workload: "
        + ", ".join(f"{n} {s:.0f} s" for n, s in took.items())
        + f"; in all {sum(took.values()) / 60:.0f} min.",
        "",
    ]
    text = "\n".join(head + intro) + "\n" + "\n".join(t.markdown() for t in tables)
    # Only a full run is "latest"; a partial one must not overwrite the other workloads' figures.
    full = not args.only and profile != "quick"
    partial = "-".join(["quick"] * args.quick + ([args.only] if args.only else [])) or "all"
    written = write(RESULTS, text, full=full, partial=partial)
    print(text)
    print(f"bench: wrote {written}", file=sys.stderr)
    return 0


def _version(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT version()").fetchone()
    return str(row[0]) if row else "unknown"


if __name__ == "__main__":
    sys.exit(main())
