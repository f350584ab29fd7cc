"""Every check has a reason and a source, and the docs page explains each one."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgonce.conformance.http import suite as http_suite
from pgonce.conformance.runner import Suite
from pgonce.conformance.webhooks import suite as webhook_suite

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "conformance.md"


@pytest.mark.parametrize("suite", [http_suite, webhook_suite], ids=["http", "webhooks"])
def test_every_check_is_explained_with_its_source(suite: Suite[object]) -> None:
    page = PAGE.read_text()
    for check in suite.catalogue():
        assert check.why
        assert check.source
        assert f"\n| `{check.name}` |" in page, f"{check.name} is not in {PAGE.name}"


def test_the_checks_run_in_the_documented_order() -> None:
    page = PAGE.read_text()
    for suite in (http_suite, webhook_suite):
        names = [check.name for check in suite.catalogue()]
        assert names == sorted(names, key=lambda name: page.index(f"\n| `{name}` |"))
