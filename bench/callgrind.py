"""One variant of an instruction-counting tool, run in a process of its own under callgrind.

The tools that count instead of timing (:mod:`bench.client_instructions`,
:mod:`bench.adapter_instructions`) run each variant twice, for a short and a long count, each time
as ``python -m <tool> DSN --variant NAME --count N`` under ``valgrind --tool=callgrind``; the
difference of the two totals, over the difference of the counts, is what one call costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path


def parser(
    tool: str, doc: str | None, variants: Iterable[str], count: int
) -> argparse.ArgumentParser:
    """The command line every such tool shares: the DSN, ``--variant NAME --count N`` (one variant
    in this process, what each measured process runs) and ``--only`` (a subset of the variants)."""
    parsed = argparse.ArgumentParser(
        prog=f"python -m {tool}", description=(doc or "").split("\n\n")[0]
    )
    parsed.add_argument("dsn")
    parsed.add_argument("--variant", choices=list(variants))
    parsed.add_argument("--count", type=int, default=count)
    parsed.add_argument("--only", help="measure only the variants whose name contains this")
    return parsed


def require_valgrind(tool: str) -> None:
    """Exit with what to install when valgrind is missing."""
    if shutil.which("valgrind") is None:
        sys.exit(f"{tool} needs valgrind (apt-get install valgrind)")


def instructions(tool: str, dsn: str, variant: str, count: int, keep: Path | None = None) -> int:
    """The instructions of a process of ``tool`` that runs ``count`` calls of ``variant``;
    its callgrind output is kept at ``keep`` when given."""
    with tempfile.TemporaryDirectory(prefix="pgonce-callgrind-") as tmp:
        out = keep or Path(tmp) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", "--dump-instr=no", f"--callgrind-out-file={out}"]
        command += [sys.executable, "-m", tool, dsn, "--variant", variant, "--count", str(count)]
        # One hash seed for every process: a dict's probing then repeats from run to run.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(command, check=True, capture_output=True, env=env)
        for line in out.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError(f"callgrind wrote no total for {variant}")
