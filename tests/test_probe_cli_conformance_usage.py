"""`pgonce conformance` without the URL to check, or `conformance webhooks` without --scheme and
--secret, is a usage error (exit 2, with the kind's usage), as argparse's own are; it was exit 1,
the status of a failed check."""

from __future__ import annotations

import pytest

from tests.test_cli import pgonce


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("http",), "pgonce conformance http: error: the URL to check is required (or --list)"),
        (
            ("webhooks",),
            "pgonce conformance webhooks: error: the URL to check is required (or --list)",
        ),
        (
            ("webhooks", "http://127.0.0.1:9/webhooks/shop"),
            "pgonce conformance webhooks: error: --scheme and --secret env:NAME are required",
        ),
        (
            ("webhooks", "http://127.0.0.1:9/webhooks/shop", "--scheme", "stripe"),
            "pgonce conformance webhooks: error: --scheme and --secret env:NAME are required",
        ),
    ],
)
def test_a_missing_argument_is_a_usage_error(args: tuple[str, ...], said: str) -> None:
    result = pgonce("conformance", *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == said
    assert f"usage: pgonce conformance {args[0]}" in result.stderr
    assert result.stdout == ""


def test_the_catalogue_needs_no_url() -> None:
    result = pgonce("conformance", "webhooks", "--list")
    assert result.returncode == 0, result.stderr
    assert "source:" in result.stdout
