"""`python -m faults.soak` (`make soak SOAK_ARGS=...`): the soak run, phases in the order given.

    python -m faults.soak                                   # short profile, every phase
    python -m faults.soak --profile long                    # 10 minutes per stress phase
    python -m faults.soak --profile short baseline idle-in-tx recovery

Starts its own PostgreSQL (embedded, temporary folder) and redis-server, like `make faults`;
writes faults/results/soak-<profile>.md and its plot beside it, headed by the commit it ran. A run
of a subset of the phases or with --seconds writes soak-<profile>-partial.md instead.
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
from pathlib import Path

from faults.__main__ import _interrupted
from faults.context import open_context
from faults.procs import ROOT
from faults.soak.phases import PHASES
from faults.soak.report import plot, render
from faults.soak.scenario import DEFAULT_PHASES, PROFILES, SoakRun, soak
from tools.provenance import header

RESULTS = ROOT / "faults" / "results"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m faults.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument(
        "--seconds", type=float, default=None, help="every phase this long (overrides the profile)"
    )
    parser.add_argument(
        "phases",
        nargs="*",
        default=[],
        metavar="PHASE",
        help=f"phases in order, from: {', '.join(PHASES)} (default: {' '.join(DEFAULT_PHASES)})",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="arrivals/s per path at the baseline (overrides)"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the logs' temporary folder")
    return parser.parse_args(argv)


def write(run: SoakRun, argv: list[str], *, partial: bool, seconds: float, postgres: str) -> Path:
    stem = f"soak-{run.profile.name}" + ("-partial" if partial else "")
    RESULTS.mkdir(exist_ok=True)
    plots = plot(run, RESULTS, stem)
    command = f'make soak SOAK_ARGS="{shlex.join(argv)}"'
    head = header(
        f"pgonce soak report ({run.profile.name})",
        command=command,
        postgres=postgres,
        profile=run.profile.what,
    )
    text = render(run, header=head, seconds=seconds, plots=plots)
    path = RESULTS / f"{stem}.md"
    path.write_text(text)
    return path


def main(argv: list[str]) -> int:
    args = parse(argv)
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        print(f"soak: unknown phases {unknown}; known: {', '.join(PHASES)}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupted)
    names = args.phases or DEFAULT_PHASES
    profile = PROFILES[args.profile]
    seed = args.seed if args.seed is not None else int(time.time())
    folder = Path(tempfile.mkdtemp(prefix="pgonce-soak-run-"))
    began = time.monotonic()
    try:
        with open_context(folder, quick=False, seed=seed) as ctx:
            postgres = ctx.pg.version()
            run = asyncio.run(soak(ctx, profile, names, seconds=args.seconds, rate=args.rate))
    finally:
        if args.keep:
            print(f"soak: logs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    # The profile's report only from the profile as it is: every phase, its lengths, its rate.
    changed = args.seconds is not None or args.rate is not None
    partial = bool(args.phases and args.phases != DEFAULT_PHASES) or changed
    path = write(run, argv, partial=partial, seconds=time.monotonic() - began, postgres=postgres)
    print(path.read_text())
    print(f"soak: wrote {path.relative_to(ROOT)}")
    return 0 if run.result.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
