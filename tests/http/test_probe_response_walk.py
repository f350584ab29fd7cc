"""The stored response an adapter makes from its captured headers in one walk of them
(``storable_pairs()`` and ``new_response()``) is the one ``Response()`` makes of the filtered
headers: the same value, and the same refusal of what a completion could not store."""

from __future__ import annotations

from typing import Any

import pytest

from pgonce.core.outcomes import Response, new_response
from pgonce.errors import UsageError
from pgonce.http.replay import storable_pairs, storable_text_pairs
from pgonce.http.semantics import CapturedResponse

RAW = [
    (b"Content-Type", b"application/json"),
    (b"content-length", b"12"),
    (b"Location", b"/payments/7"),
    (b"Set-Cookie", b"session=1"),
    (b"x-trace", b"caf\xe9"),
    (b"Date", b"Mon, 07 Dec 2026 08:00:00 GMT"),
    (b"X-Repeated", b"1"),
    (b"x-repeated", b"2"),
]

#: What a replay may send again of RAW: lower-cased text names, in order, repeats kept.
STORED = [
    ("content-type", "application/json"),
    ("location", "/payments/7"),
    ("x-trace", "caf\xe9"),
    ("x-repeated", "1"),
    ("x-repeated", "2"),
]


def test_pairs_are_the_stored_headers_in_order() -> None:
    assert storable_pairs(RAW) == STORED
    text = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in RAW]
    assert storable_text_pairs(text) == STORED


class _Name(str):
    pass


@pytest.mark.parametrize(
    ("status", "pairs", "body"),
    [
        (201, [("content-type", "application/json"), ("location", "/p/1")], b"{}"),
        (None, [], b""),
        (200, [("x-trace", "caf\xe9")], b"latin-1 value"),  # not ASCII, but text
        (200, [(_Name("x-name"), "v")], b"a str subclass"),
        (2**31 - 1, [("a", "b")], b""),
        (-(2**31), [("a", "b")], b""),
    ],
)
def test_new_response_is_the_response(status: Any, pairs: list[Any], body: bytes) -> None:
    made = new_response(status, list(pairs), body)
    expected = Response(status, tuple(pairs), body)
    assert made == expected
    assert type(made) is Response
    assert made.headers == tuple(pairs)
    assert type(made.headers) is tuple


def _refusal(call: Any) -> str:
    with pytest.raises(UsageError) as refused:
        call()
    return str(refused.value)


@pytest.mark.parametrize(
    ("status", "pairs", "body"),
    [
        (200, [("x-nul", "a\x00b")], b""),
        (200, [("x\x00", "v")], b""),
        (200, [("x-lone", "\udc80")], b""),
        (200, [(b"bytes-name", "v")], b""),
        (200, [("x-number", 7)], b""),
        (2**31, [], b""),
        (True, [], b""),
        ("200", [], b""),
        (200, [], "text body"),
    ],
)
def test_new_response_refuses_what_response_refuses(
    status: Any, pairs: list[Any], body: Any
) -> None:
    expected = _refusal(lambda: Response(status, tuple(pairs), body))
    assert _refusal(lambda: new_response(status, list(pairs), body)) == expected


def test_a_captured_response_is_stored_as_before() -> None:
    captured = CapturedResponse(1024)
    captured.status = 201
    captured.headers = list(RAW)
    captured.body = [b"{", b"}"]
    assert captured.response() == Response(201, tuple(STORED), b"{}")
    captured.text_headers = [("Location", "/p/2"), ("Set-Cookie", "s=1"), ("Content-Length", "2")]
    assert captured.response() == Response(201, (("location", "/p/2"),), b"{}")
    captured.text_headers = [("X-Nul", "a\x00")]
    with pytest.raises(UsageError, match="NUL"):
        captured.response()
