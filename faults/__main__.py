"""`python -m faults` (`make faults`): run the fault and bad-input suite, write the report.

Starts its own PostgreSQL (embedded, in a temporary folder) and its own redis-server on a free
loopback port (the pgbouncer and failover scenarios also a PgBouncer and a pg_auto_failover monitor
with two nodes, from the machine's Debian packages), runs every scenario against real service
processes, prints the results table and writes faults/results/latest.md. Stops by itself: every
scenario is bounded, and the whole run is cut off after --timeout. Kills and stops only processes
it started; deletes its temporary folders.

    python -m faults                  # the full run (~20 minutes on 2 cores), writes latest.md
    python -m faults --quick          # a short run; writes results/partial-quick.md
    python -m faults --only storm --only bad   # scenarios whose name starts with these words;
                                               # writes results/partial-storm-bad.md

Only a full run of every scenario writes latest.md, headed by the commit it ran (and whether the
tree had uncommitted changes), the date, the machine, the PostgreSQL version and the profile.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

from faults.context import Context, open_context
from faults.procs import ROOT
from faults.report import Result, render
from faults.scenarios import (
    badinput,
    broker,
    database,
    failover,
    kills,
    pooler,
    security,
    storms,
    twophase,
)
from faults.soak import scenario as soak
from tools.provenance import header, write

Scenario = Callable[[Context], Awaitable[Result]]

#: In running order. Names are what --only matches.
SCENARIOS: list[tuple[str, Scenario]] = [
    ("storm-http", storms.middleware_storm),
    ("storm-webhooks", storms.webhook_storm),
    ("kill", kills.kill_nine),
    ("two-phase", twophase.two_phase_kills),
    ("pg-restart", database.postgres_restarts),
    ("pg-cut", database.connection_cuts),
    ("pg-timeout", database.statement_timeouts),
    ("broker", broker.broker_outage),
    ("bad-webhooks", badinput.bad_webhooks),
    ("bad-http", badinput.bad_requests),
    ("security", security.cross_scope_and_admin),
    ("pgbouncer", pooler.pgbouncer_load),
    ("failover-graceful", failover.graceful),
    ("failover-kill", failover.kill_primary),
    ("soak", soak.scenario),
]

RESULTS = ROOT / "faults" / "results"
#: The issue's budget for the full run; the suite cuts itself off before it.
DEFAULT_TIMEOUT = 20 * 60


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m faults",
        description="Fault and bad-input suite: kills, PostgreSQL restarts, cut connections, "
        "broker outages, retry storms and 10,000 generated bad inputs against the real service.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a short run (a few kills, small storms, ~1 minute)"
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run scenarios whose name starts with NAME (repeatable): "
        + ", ".join(name for name, _ in SCENARIOS),
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: the clock)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds after which the run is cut off (default: 1200, the issue's budget)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary folder with the processes' logs and configurations (its path "
        "is printed); the database folder is always deleted",
    )
    return parser.parse_args(argv)


async def run_all(ctx: Context, chosen: list[tuple[str, Scenario]]) -> list[Result]:
    results: list[Result] = []
    for name, scenario in chosen:
        began = time.monotonic()
        print(f"faults: {name} ...", flush=True)
        try:
            result = await scenario(ctx)
        except Exception as error:
            # Where it was raised, in the report itself: stderr is often not kept.
            frames = traceback.extract_tb(error.__traceback__)[-4:]
            where = " < ".join(
                f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)
            )
            result = Result(name, "-", "-", error=f"{type(error).__name__}: {error} (at {where})")
            traceback.print_exc()
        result.seconds = time.monotonic() - began
        print(
            f"faults: {name}: {'pass' if result.passed else 'FAIL'} in {result.seconds:.0f} s "
            f"(sent {result.acc.sent}, lost {result.acc.lost}, doubled {result.acc.doubled}, "
            f"500 {result.acc.http_500})",
            flush=True,
        )
        results.append(result)
    results.append(security.scan_secrets_and_tracebacks(ctx))
    return results


def _interrupted(signum: int, frame: object) -> None:
    # SIGTERM (a CI timeout, `timeout`) unwinds like Ctrl-C, so that every process and server the
    # suite started is stopped and its folders deleted.
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    chosen = [
        (name, fn)
        for name, fn in SCENARIOS
        if not args.only or any(name.startswith(o) for o in args.only)
    ]
    if not chosen:
        print(f"faults: no scenario matches {args.only}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int(time.time())
    began = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="pgonce-faults-run-"))
    results: list[Result] = []
    postgres = "-"
    try:
        with open_context(folder, quick=args.quick, seed=seed) as ctx:
            postgres = ctx.pg.version()
            try:
                results = asyncio.run(asyncio.wait_for(run_all(ctx, chosen), args.timeout))
            except TimeoutError:
                print(f"faults: cut off after {args.timeout:.0f} s", file=sys.stderr)
                return 1
    finally:
        if args.keep:
            print(f"faults: logs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    # The command that reruns this very run: the same arguments and the seed it used.
    rerun = [a for a in argv if a != "--keep"]
    if args.seed is None:
        rerun += ["--seed", str(seed)]
    command = f'make faults FAULTS_ARGS="{shlex.join(rerun)}"'
    full = not args.quick and not args.only
    profile = (
        ("quick (small sizes, ~1 minute)" if args.quick else "full")
        + ("" if not args.only else f", only {', '.join(name for name, _ in chosen)}")
        + f", seed {seed}"
    )
    head = header("pgonce reliability report", command=command, postgres=postgres, profile=profile)
    text = render(results, header=head, seconds=time.monotonic() - began)
    print(text)
    written = write(RESULTS, text, full=full, partial="-".join(["quick"] * args.quick + args.only))
    print(f"faults: wrote {written.relative_to(ROOT)}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
