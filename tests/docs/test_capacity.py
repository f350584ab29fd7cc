"""The capacity figures of "Beyond one primary" come from the latest benchmark report."""

from __future__ import annotations

import re

import pytest

from tools import docs_capacity


def test_the_figures_are_the_reports() -> None:
    report = docs_capacity.REPORT.read_text()
    page = docs_capacity.capacity()
    commit = re.search(r"^Commit: `([0-9a-f]{7})", report, re.MULTILINE)
    assert commit is not None
    assert f"of {commit.group(1)}," in page
    # The fresh key's row of the report's cost table is the page's CPU per claimed request.
    row = next(line for line in report.splitlines() if line.startswith("| fresh key, begin()"))
    cpu = row.split("|")[2].strip()
    assert f"about {cpu} µs of PostgreSQL CPU" in page


def test_a_missing_row_fails_the_build_by_name() -> None:
    report = docs_capacity.REPORT.read_text()
    without = "\n".join(
        line for line in report.splitlines() if not line.startswith("| fresh key, begin()")
    )
    with pytest.raises(ValueError, match="fresh key, begin"):
        docs_capacity.capacity(without)
