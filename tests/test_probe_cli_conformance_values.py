"""A URL that does not parse (a bad port, an unclosed IPv6 bracket) and a duration too large for
the kit's timedeltas are usage errors (exit 2) naming the value, a password never shown; they were
internal errors (OverflowError from the connect, ValueError from the URL's split, OverflowError
from the tolerance's timedelta)."""

from __future__ import annotations

import pytest

from tests.test_cli import pgonce

SECRET = {"CONFORMANCE_SECRET": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}
HOOK = ("webhooks", "http://127.0.0.1:9/webhooks/shop", "--scheme", "stripe")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("http", "http://127.0.0.1:99999/pay"),
            "'http://127.0.0.1:99999/pay' is not an http(s) URL",
        ),
        (
            ("http", "http://user:hunter2@127.0.0.1:99999/pay"),
            "'http://***@127.0.0.1:99999/pay' is not an http(s) URL",
        ),
        (
            ("http", "http://user:hunter2@[::1/pay"),
            "'http://***@[::1/pay' is not an http(s) URL",
        ),
        (
            ("http", "http://127.0.0.1:9/pay", "--count-url", "http://127.0.0.1:port/n"),
            "'http://127.0.0.1:port/n' is not an http(s) URL",
        ),
        (
            (*HOOK, "--secret", "env:CONFORMANCE_SECRET", "--tolerance", "1e300"),
            "argument --tolerance: 1e300 seconds is out of range",
        ),
        (("http", "http://127.0.0.1:9/pay", "--budget", "1e300"), "argument --budget: 1e300"),
    ],
)
def test_a_value_that_does_not_parse_is_a_usage_error(args: tuple[str, ...], said: str) -> None:
    result = pgonce("conformance", *args, env=SECRET)
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"pgonce conformance {args[0]}: error: {said}"), last
    assert f"usage: pgonce conformance {args[0]}" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout
    assert "internal error" not in result.stderr
