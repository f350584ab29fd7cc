"""The default scope names the function: one that has no name of its own is refused."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce.decorator import idempotent
from pgonce.errors import UsageError


def test_two_lambdas_never_share_a_default_scope(conn: psycopg.Connection[Any]) -> None:
    # Both were scoped "<module>.<lambda>": the second, called with the first's key and
    # arguments, replayed the first's result without running.
    with pytest.raises(UsageError, match="scope="):
        idempotent(key="k")(lambda conn, k: "first")
    first = idempotent(key="k", scope="first")(lambda conn, k: "first")
    second = idempotent(key="k", scope="second")(lambda conn, k: "second")
    assert first(conn, "k-1") == "first"
    assert second(conn, "k-1") == "second"


def test_a_named_local_function_keeps_its_default_scope(conn: psycopg.Connection[Any]) -> None:
    @idempotent(key="k")
    def local(conn: psycopg.Connection[Any], k: str) -> str:
        return "ran"

    assert local(conn, "k-2") == "ran"


def test_a_scope_no_connection_can_send_is_refused_when_decorating() -> None:
    # A lone surrogate passed the decoration and failed every call.
    with pytest.raises(UsageError, match="surrogate"):
        idempotent(key="k", scope="orders-\udcff")
