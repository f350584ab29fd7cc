"""An int key with more digits than Python writes out (``sys.get_int_max_str_digits()``).

Its text is the key, and no key that long is allowed (512 bytes); ``str()`` of it raised
``ValueError`` ("Exceeds the limit ... for integer string conversion") from inside the call,
an error of Python's that named neither the key nor the decorator. Now the key's own
:class:`~pgonce.UsageError`, before the claim, with nothing run.
"""

from __future__ import annotations

import sys
from typing import Any

import psycopg
import pytest

from pgonce import UsageError, idempotent

HUGE = 10 ** (sys.get_int_max_str_digits() + 1)


def test_an_int_key_too_long_to_write_out_is_a_usage_error(conn: psycopg.Connection[Any]) -> None:
    ran: list[int] = []

    @idempotent(key="order", scope="huge-int")
    def ship(conn: psycopg.Connection[Any], order: int) -> int:
        ran.append(1)
        return 1

    @idempotent(key=lambda conn, order: order, scope="huge-int-function")
    def ship_by_function(conn: psycopg.Connection[Any], order: int) -> int:
        ran.append(1)
        return 1

    with pytest.raises(UsageError, match="the key's value is an int too long to be a key"):
        ship(conn, HUGE)
    with pytest.raises(UsageError, match="the key's value is an int too long to be a key"):
        ship_by_function(conn, HUGE)
    assert ran == []
    conn.commit()
    assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)
