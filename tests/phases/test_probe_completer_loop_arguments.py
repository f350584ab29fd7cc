"""The completer loop's arguments are refused at its start. An ``every`` given in seconds (5) was
a bare TypeError from a comparison; a ``retire_after``, a registry or an ``on_run`` that cannot be
used were found only by the first pass that reached the database: with the database away at
start, the loop logged outages and retried, and ended with the UsageError once it came back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pgonce import Response, UsageError
from pgonce.store._async.phases import AsyncPhaseStore, complete_every


async def pay(op: Any) -> Response:
    return Response(201)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"every": 5}, "the completer's interval must be a datetime.timedelta"),
        ({"retire_after": 0}, "retire_after is a whole number"),
        ({"operations": [pay]}, "operations maps each operation's name"),
        ({"operations": {"pay": "shop:pay"}}, "the registered work of 'pay' must be a function"),
        ({"on_run": "log"}, "on_run must be a function"),
    ],
)
async def test_the_completer_loop_refuses_its_arguments_before_any_pass(
    options: dict[str, Any], message: str
) -> None:
    arguments: dict[str, Any] = {"operations": {"pay": pay}, **options}
    operations = arguments.pop("operations")
    with pytest.raises(UsageError, match=message):
        await complete_every(
            None,  # type: ignore[arg-type]  # never reached: no pass runs
            AsyncPhaseStore(),
            operations,
            asyncio.Event(),
            **arguments,
        )
