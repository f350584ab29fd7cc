"""A decorated method: its default payload holds ``self``, and the refusal says so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from pgonce.decorator import idempotent
from pgonce.errors import UsageError


class Charges:
    @idempotent(key="order_id")
    def charge(self, conn: psycopg.Connection[Any], order_id: str) -> int:
        return 1

    @idempotent(key="order_id", payload=lambda self, conn, order_id: order_id)
    def charge_keyed(self, conn: psycopg.Connection[Any], order_id: str) -> int:
        conn.execute("SELECT 1")
        return 2


@dataclass
class Plain:
    region: str

    @idempotent(key="order_id")
    def charge(self, conn: psycopg.Connection[Any], order_id: str) -> str:
        return self.region


def test_a_method_whose_instance_has_no_json_form_names_self(
    conn: psycopg.Connection[Any],
) -> None:
    with pytest.raises(UsageError, match=r"self among them.*payload="):
        Charges().charge(conn, "o-1")
    conn.rollback()


def test_a_method_with_a_payload_runs_and_replays(conn: psycopg.Connection[Any]) -> None:
    assert Charges().charge_keyed(conn, "o-2") == 2
    conn.commit()
    assert Charges().charge_keyed(conn, "o-2") == 2


def test_a_method_of_a_dataclass_is_fingerprinted_with_its_fields(
    conn: psycopg.Connection[Any],
) -> None:
    assert Plain("eu").charge(conn, "o-3") == "eu"
    conn.commit()
    assert Plain("eu").charge(conn, "o-3") == "eu"
