"""Where a published report comes from: the commit it measured, the machine, the server, the run.

`make bench` and `make faults` head their reports with :func:`header`, so that a report says which
code it is one run of, and a test (tests/test_reports.py) can compare that commit with the last
commit that changed the code it measures. A full run writes the report; a partial run (some
workloads or scenarios, or a short profile) writes a partial file beside it and never replaces it.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The line of a report that names its commit; what the staleness test reads.
COMMIT_LINE = re.compile(r"^Commit: `([0-9a-f]{40})` \((clean tree|uncommitted changes)\)$", re.M)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


@dataclass(frozen=True)
class Checkout:
    commit: str
    #: Uncommitted changes to tracked files outside the reports themselves.
    dirty: bool


def checkout() -> Checkout:
    """The commit checked out, and whether the tree differs from it (reports excluded: a run
    that replaces them is still a run of the commit)."""
    status = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ".",
        ":(exclude)bench/results", ":(exclude)faults/results",
    )  # fmt: skip
    return Checkout(commit=_git("rev-parse", "HEAD"), dirty=bool(status))


def machine() -> str:
    """CPU model and count, architecture and kernel: what the figures were measured on."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} × {model}, {platform.machine()}, {platform.system()} "
        f"{platform.release()}, {platform.python_implementation()} {platform.python_version()}"
    )


def header(title: str, *, command: str, postgres: str, profile: str) -> list[str]:
    """The lines every report starts with; ``postgres`` is the server's ``version()``."""
    state = checkout()
    return [
        f"# {title}",
        "",
        f"Commit: `{state.commit}` ({'uncommitted changes' if state.dirty else 'clean tree'})",
        "",
        f"- **command**: `{command}`",
        f"- **date**: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- **machine**: {machine()}",
        f"- **PostgreSQL**: {postgres}",
        f"- **profile**: {profile}",
        "",
    ]


def report_commit(text: str) -> Checkout | None:
    """The commit a report names in its header, or None for a report without one."""
    found = COMMIT_LINE.search(text)
    if found is None:
        return None
    return Checkout(commit=found.group(1), dirty=found.group(2) != "clean tree")


def last_change(*paths: str) -> str:
    """The last commit that changed any of ``paths`` (pathspecs, exclusions allowed)."""
    return _git("log", "-1", "--format=%H", "--", *paths)


def contains(descendant: str, ancestor: str) -> bool:
    """Whether ``ancestor`` is ``descendant`` or one of its ancestors."""
    done = subprocess.run(
        ["git", "merge-base", "--is-ancestor", ancestor, descendant], cwd=ROOT, check=False
    )
    return done.returncode == 0


def write(results: Path, text: str, *, full: bool, partial: str) -> Path:
    """``latest.md`` in ``results`` for a full run; ``partial-<partial>.md`` otherwise."""
    results.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", partial.lower()).strip("-") or "run"
    path = results / ("latest.md" if full else f"partial-{slug}.md")
    path.write_text(text)
    return path
