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


PAY = ("http", "http://127.0.0.1:9/pay")
HOOK = ("webhooks", "http://127.0.0.1:9/webhooks/shop", "--secret", "env:CONFORMANCE_SECRET")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("http", "notaurl"), "'notaurl' is not an http(s) URL"),
        (
            ("http", "http://127.0.0.1:9/pay", "--count-url", "ftp://127.0.0.1:9/count"),
            "'ftp://127.0.0.1:9/count' is not an http(s) URL",
        ),
        (
            (*PAY, "--count-url", "http://127.0.0.1:9/n", "--count-sql", "SELECT 1"),
            "give --count-url or --count-sql, not both",
        ),
        (
            ("http", "http://127.0.0.1:9/pay", "--header", "Authorization: env:CONFORMANCE_UNSET"),
            "--header: the environment variable 'CONFORMANCE_UNSET' is not set",
        ),
        (
            ("http", "http://127.0.0.1:9/pay", "--only", "no-such-check"),
            "no http check named no-such-check; known: ",
        ),
        (
            ("http", "http://127.0.0.1:9/pay", "--count-sql", "SELECT 1", "--dsn", "env:NOPE_X"),
            "--dsn: the environment variable 'NOPE_X' is not set",
        ),
        ((*HOOK, "--scheme", "generic-hmac", "--option", "header"), "--option must be KEY=VALUE"),
        (
            (*HOOK, "--scheme", "generic-hmac"),
            "the generic-hmac scheme needs the 'header' option (the signature header)",
        ),
        (
            (*HOOK[:2], "--scheme", "stripe", "--secret", "env:CONFORMANCE_UNSET"),
            "--secret: the environment variable 'CONFORMANCE_UNSET' is not set",
        ),
    ],
)
def test_a_bad_value_is_a_usage_error_before_anything_runs(
    args: tuple[str, ...], said: str
) -> None:
    """Each was exit 1 (a failed check's status) from inside the run; now exit 2 with the usage.
    The URLs point at a closed port: reaching the run would say "cannot reach" instead."""
    result = pgonce(
        "conformance", *args, env={"CONFORMANCE_SECRET": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"pgonce conformance {args[0]}: error: {said}"), last
    assert f"usage: pgonce conformance {args[0]}" in result.stderr
    assert result.stdout == ""
