"""The receiver while another session holds a lock on the inbox table (a LOCK TABLE, an ALTER
TABLE under way): deliveries wait a bounded time and are answered 503 with Retry-After, not for
as long as the lock lasts, each holding one of the pool's connections; none is stored, and the
provider's retry once the lock is gone is stored as usual."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import httpx
import psycopg
import pytest

from pgonce.webhooks import receiver as receiver_module
from pgonce.webhooks.receiver import InboxReceiver
from tests.inbox.conftest import SCHEMA, hmac_scheme, serve, source


def delivery(n: int) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"type": "order.paid", "order": n}).encode()
    return body, hmac_scheme().sign(body, event_id=f"evt_{n}")


@pytest.mark.pooled
async def test_a_locked_inbox_is_answered_503_within_the_bound(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(receiver_module, "STORE_LOCK_TIMEOUT", timedelta(milliseconds=300))
    receiver = InboxReceiver([source()], dsn=dsn, schema=SCHEMA)
    with serve(receiver) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            with psycopg.connect(dsn) as holder:
                holder.execute(f"LOCK TABLE {SCHEMA}.inbox")
                # More deliveries than the receiver's pool has connections (two).
                answers = await asyncio.gather(
                    *(
                        client.post("/webhooks/shop", content=body, headers=headers)
                        for body, headers in map(delivery, range(6))
                    )
                )
                holder.rollback()
            assert [a.status_code for a in answers] == [503] * 6, [a.text for a in answers]
            for answer in answers:
                assert answer.headers["retry-after"].isdigit()
                assert answer.headers["content-type"] == "application/problem+json"
            with psycopg.connect(dsn) as conn:
                assert conn.execute(f"SELECT count(*) FROM {SCHEMA}.inbox").fetchone() == (0,)
            # The provider's retries, the lock gone.
            retries = [
                await client.post("/webhooks/shop", content=body, headers=headers)
                for body, headers in map(delivery, range(6))
            ]
    assert [(r.status_code, r.json()["outcome"]) for r in retries] == [(200, "stored")] * 6
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {SCHEMA}.inbox").fetchone() == (6,)


def without_pipeline(self: object, check: bool = False) -> bool:
    """psycopg's answer on a libpq before 14, which has no pipeline mode."""
    if check:
        raise psycopg.NotSupportedError("Connection.pipeline() requires libpq 14.0 or greater")
    return False


async def test_a_libpq_without_pipeline_mode_stores_deliveries(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(type(psycopg.capabilities), "has_pipeline", without_pipeline)
    receiver = InboxReceiver([source()], dsn=dsn, schema=SCHEMA)
    with serve(receiver) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            body, headers = delivery(1)
            first = await client.post("/webhooks/shop", content=body, headers=headers)
            again = await client.post("/webhooks/shop", content=body, headers=headers)
    assert (first.status_code, first.json()["outcome"]) == (200, "stored"), first.text
    assert (again.status_code, again.json()["outcome"]) == (200, "duplicate"), again.text
