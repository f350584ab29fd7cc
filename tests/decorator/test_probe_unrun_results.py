"""A decorated function that returns work not done yet: a coroutine (an async function behind a
plain wrapper, which ``@idempotent`` cannot tell from a plain function) or a generator (a
callable object whose ``__call__`` is a generator function).

Nothing ran inside the claim, so nothing may be stored and the key stays free; the error says
what happened (not "give a codec", which would store a coroutine's repr as done work), and the
coroutine or generator is closed, so that it never runs later outside the claim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import psycopg
import pytest

from pgonce import UsageError, idempotent

made: list[Any] = []


def plain_wrapper(
    function: Callable[..., Coroutine[Any, Any, Any]],
) -> Callable[..., Coroutine[Any, Any, Any]]:
    """A decorator of the kind that hides that its function is async (a tracing one)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        coroutine = function(*args, **kwargs)
        made.append(coroutine)
        return coroutine

    return wrapper


def keys(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("commit", [False, True], ids=["joined", "owned"])
def test_a_coroutine_returned_by_a_plain_wrapper_is_refused_and_closed(
    dsn: str, commit: bool
) -> None:
    ran: list[str] = []

    @idempotent(key="order", scope=f"wrapped-{commit}", commit=commit)
    @plain_wrapper
    async def ship(conn: Any, order: str) -> str:
        ran.append(order)
        return order

    made.clear()
    with psycopg.connect(dsn) as conn:
        with pytest.raises(UsageError, match="returned a coroutine, which has not run"):
            ship(conn, "o-1")  # type: ignore[unused-coroutine]
        conn.rollback()
    assert made[0].cr_frame is None  # closed: it can never run outside the claim
    assert ran == []
    assert keys(dsn) == 0  # nothing stored: the key is free


def test_a_generator_returned_by_a_callable_object_is_refused_and_closed(dsn: str) -> None:
    ran: list[str] = []
    made.clear()

    class Shipments:
        def __call__(self, conn: Any, order: str) -> Iterator[str]:
            ran.append(order)
            yield order

    def shipments(conn: Any, order: str) -> Iterator[str]:
        generator = Shipments()(conn, order)
        made.append(generator)
        return generator

    ship = idempotent(key="order", scope="callable-generator")(shipments)
    with psycopg.connect(dsn) as conn:
        with pytest.raises(UsageError, match="returned a generator, which has not run"):
            ship(conn, "o-1")
        conn.rollback()
    assert made[0].gi_frame is None
    assert ran == []
    assert keys(dsn) == 0
