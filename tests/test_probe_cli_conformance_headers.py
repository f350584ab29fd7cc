"""A header, content type or method the wire cannot carry (a non-ASCII value, a space in a name)
is a usage error (exit 2) before anything is sent; a non-ASCII value was an internal error
(UnicodeEncodeError from the HTTP client), the others a "cannot reach" of the endpoint."""

from __future__ import annotations

import pytest

from tests.test_cli import pgonce

PAY = ("http", "http://127.0.0.1:9/pay")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--header", "Authorization: env:CONFORMANCE_TOKEN"), "the value of the Authorization"),
        (("--content-type", "text/caf\u00e9\u2713"), "the value of the Content-Type header"),
        (("--expires-header", "Expires\u2713"), "'Expires\u2713' is not an HTTP header name"),
        (("--header", "X Y: 1"), "'X Y' is not an HTTP header name"),
        (("--method", "PO ST"), "'PO ST' is not an HTTP method"),
    ],
)
def test_what_the_wire_cannot_carry_is_a_usage_error(args: tuple[str, ...], said: str) -> None:
    result = pgonce(
        "conformance", *PAY, *args, env={"CONFORMANCE_TOKEN": "Bearer s\u00e9kr\u2713t"}
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"pgonce conformance http: error: {said}"), last
    assert "s\u00e9kr" not in result.stderr
