"""The published reports are one run of the code they describe.

bench/results/latest.md and faults/results/latest.md name, in their header, the commit they ran
(tools/provenance.py). Each must be a run of a commit that already holds the last change to the
code it measures, on a clean tree; otherwise the figures describe code that no longer exists and
the test names the command that regenerates the report. The reports themselves are left out of
"the code": committing a regenerated report must not make it stale.
"""

from __future__ import annotations

import shutil

import pytest

from tools.provenance import ROOT, contains, last_change, report_commit

#: (report, the code it measures, the command that regenerates it in one piece)
REPORTS = [
    (
        "bench/results/latest.md",
        ("src", "bench", ":(exclude)bench/results"),
        'make bench BENCH_ARGS="--profile short"',
    ),
    (
        "faults/results/latest.md",
        ("src", "faults", ":(exclude)faults/results"),
        "make faults",
    ),
]


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(),
    reason="not a git checkout: a report's commit cannot be compared",
)
@pytest.mark.parametrize(("report", "code", "command"), REPORTS, ids=[r[0] for r in REPORTS])
def test_report_is_a_run_of_the_current_code(
    report: str, code: tuple[str, ...], command: str
) -> None:
    header = report_commit((ROOT / report).read_text())
    assert header is not None, f"{report} names no commit: regenerate it with `{command}`"
    assert not header.dirty, (
        f"{report} was measured on a tree with uncommitted changes: regenerate it with "
        f"`{command}` on a clean checkout"
    )
    changed = last_change(*code)
    assert contains(header.commit, changed), (
        f"{report} is a run of {header.commit[:10]}, older than {changed[:10]}, the last change "
        f"to {', '.join(c for c in code if not c.startswith(':'))}: regenerate it with "
        f"`{command}` and commit it"
    )
