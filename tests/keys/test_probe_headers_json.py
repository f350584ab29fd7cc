"""wire.headers_json(): the stored JSON of a response's headers, and which sets it keeps.

It must write what ``json.dumps`` writes (compact, ASCII) for any headers, and keep (find again
by value) only a tuple of ``(str, str)`` tuples, which cannot change after it was encoded.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pgonce.store import wire


class Text(str):
    """A str whose value may be read differently from what it holds."""


CASES: list[Any] = [
    (),
    (("content-type", "application/json"),),
    (("content-type", "application/json"), ("location", "/payments/17")),
    (("x-quote", 'a "b" \\ c'), ("x-control", "\t\n\x01"), ("x-unicode", "é ü 日本 \U0001f600")),
    (("set-cookie", "a=1"), ("set-cookie", "b=2")),
    [("content-type", "text/plain")],
    (["content-type", "text/plain"],),
]


def _expected(headers: Any) -> bytes:
    return json.dumps([list(pair) for pair in headers], separators=(",", ":")).encode()


@pytest.mark.parametrize("headers", CASES)
def test_what_json_dumps_writes(headers: Any) -> None:
    assert wire.headers_json(headers) == _expected(headers)
    assert wire.headers_json(headers) == _expected(headers)  # found again, or encoded again


def test_a_tuple_of_str_pairs_is_kept_and_found_by_value() -> None:
    headers = (("content-type", "application/json"), ("location", "/kept/1"))
    first = wire.headers_json(headers)
    assert wire._HEADERS_JSON[headers] is first
    equal = tuple((str(name), "".join(value)) for name, value in headers)
    assert wire.headers_json(equal) is first


@pytest.mark.parametrize(
    "headers",
    [
        (("content-type", Text("application/json")),),
        ((Text("content-type"), "application/json"),),
        (["content-type", "application/json"], ("x-a", "b")),
        [("content-type", "application/json")],
    ],
    ids=["str-subclass-value", "str-subclass-name", "list-pair", "list"],
)
def test_anything_else_is_encoded_and_not_kept(headers: Any) -> None:
    wire._HEADERS_JSON.clear()
    assert wire.headers_json(headers) == _expected(headers)
    assert wire._HEADERS_JSON == {}


def test_the_kept_sets_are_bounded() -> None:
    wire._HEADERS_JSON.clear()
    for n in range(wire.MAX_HEADER_SETS + 5):
        wire.headers_json((("location", f"/bounded/{n}"),))
    assert 0 < len(wire._HEADERS_JSON) <= wire.MAX_HEADER_SETS
