"""The decorated function keeps its signature for type checkers: mypy (``make lint``) checks this
file, and every ``type: ignore`` below must be needed (``warn_unused_ignores``), so a decorator
that lost the parameters (``Callable[..., Any]``) or the return type would fail the lint.

The calls with wrong arguments also fail at run time, before anything reaches the database.
"""

from __future__ import annotations

from typing import Any, assert_type

import psycopg
import pytest

from pgonce import idempotent


@idempotent(key="order_id")
def charge(conn: psycopg.Connection[Any], order_id: str, amount: int) -> dict[str, int]:
    return {"amount": amount}


@idempotent(key="order_id", commit=True)
async def charge_async(conn: psycopg.AsyncConnection[Any], order_id: str) -> list[str]:
    return [order_id]


def sync_call(conn: psycopg.Connection[Any]) -> None:
    assert_type(charge(conn, "o-1", 5), dict[str, int])
    assert_type(charge(conn, order_id="o-1", amount=5), dict[str, int])


async def async_call(conn: psycopg.AsyncConnection[Any]) -> None:
    assert_type(await charge_async(conn, "o-1"), list[str])


def test_wrong_arguments_are_refused_by_the_type_checker_and_at_run_time() -> None:
    conn: Any = None
    with pytest.raises(TypeError):
        charge(conn, "o-1")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        charge(conn, "o-1", 5, 6)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        charge(conn, "o-1", currency="EUR")  # type: ignore[call-arg]


def test_the_wrapper_keeps_the_name_and_the_coroutine_nature() -> None:
    import inspect

    assert charge.__name__ == "charge"
    assert inspect.iscoroutinefunction(charge_async)
    assert not inspect.iscoroutinefunction(charge)
    assert list(inspect.signature(charge).parameters) == ["conn", "order_id", "amount"]
