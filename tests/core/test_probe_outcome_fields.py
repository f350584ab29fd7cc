"""The key store's quick constructors of its outcomes make the very values the dataclasses make.

won(), replay(), stored_replay(), the checked Response and new_response() fill a plain twin of
the class's slots and then give it the class: the result must be indistinguishable from
``Won(...)``, ``Replay(...)`` and ``Response(...)`` -- its type, equality, hash, repr, frozenness,
pickling and dataclasses.replace().
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from datetime import UTC, datetime
from typing import Any

import pytest

from pgonce.core.outcomes import (
    Replay,
    Response,
    Won,
    _checked_response,
    new_response,
    replay,
    stored_replay,
    won,
)

CLAIMED = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
COMPLETED = datetime(2026, 1, 2, 3, 4, 6, tzinfo=UTC)
HEADERS = (("content-type", "application/json"), ("x-id", "7"))
FP = bytes(range(32))


def _pairs() -> list[tuple[Any, Any]]:
    response = Response(201, HEADERS, b'{"id": 7}')
    return [
        (won("s", "k", FP, CLAIMED), Won("s", "k", FP, CLAIMED)),
        (
            won("s", "k", FP, CLAIMED, b"\x00\x01", b"\x02", "conn"),
            Won("s", "k", FP, CLAIMED, row=b"\x00\x01", xact=b"\x02", conn="conn"),
        ),
        (replay(response, CLAIMED, COMPLETED), Replay(response, CLAIMED, COMPLETED)),
        (
            stored_replay(201, HEADERS, b'{"id": 7}', CLAIMED, COMPLETED),
            Replay(response, CLAIMED, COMPLETED),
        ),
        (stored_replay(None, (), b"", CLAIMED, CLAIMED), Replay(Response(), CLAIMED, CLAIMED)),
        (_checked_response(201, HEADERS, b'{"id": 7}'), response),
        (new_response(201, list(HEADERS), b'{"id": 7}'), response),
        (new_response(None, [], b""), Response()),
    ]


@pytest.mark.parametrize(("made", "expected"), _pairs())
def test_made_is_the_dataclass_value(made: Any, expected: Any) -> None:
    assert type(made) is type(expected)
    assert made == expected
    assert hash(made) == hash(expected)
    assert repr(made) == repr(expected)
    assert dataclasses.fields(made) == dataclasses.fields(expected)
    for field in dataclasses.fields(expected):
        assert getattr(made, field.name) == getattr(expected, field.name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, dataclasses.fields(expected)[0].name, None)
    assert pickle.loads(pickle.dumps(made)) == expected
    assert copy.copy(made) == expected
    assert copy.deepcopy(made) == expected


def test_replace_keeps_the_class_and_the_fields_not_compared() -> None:
    made = won("s", "k", FP, CLAIMED, b"\x00\x01", b"\x02", "conn")
    again = dataclasses.replace(made, key="other")
    assert type(again) is Won
    assert (again.key, again.row, again.xact, again.conn) == ("other", b"\x00\x01", b"\x02", "conn")
    assert isinstance(stored_replay(201, HEADERS, b"", CLAIMED, CLAIMED).response, Response)
