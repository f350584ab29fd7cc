"""What the relay publishes is jsonb's text of the payload, as the how-to says."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from pgonce.store._sync.outbox import OutboxStore, enqueue


def test_the_published_payload_is_jsonbs_text_of_it(conn: psycopg.Connection[Any]) -> None:
    payload = {"zz": 1e16, "k": {"yy": 1, "x": 2}, "a": [-0.0, 0.1, 1.0], 1: "a", "1": "b"}
    enqueue(conn, "order", "1", "order.created", payload)
    conn.commit()
    (message,) = OutboxStore().claim(conn, limit=1)
    conn.rollback()
    assert message.payload_json == (
        '{"1": "b", "a": [0.0, 0.1, 1.0], "k": {"x": 2, "yy": 1}, "zz": 10000000000000000}'
    )
    assert message.payload_json != json.dumps(payload)
    assert type(message.payload["zz"]) is int
