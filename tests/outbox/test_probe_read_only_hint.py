"""What a read-only refusal tells to do: end "the caller's read-only transaction" only where a
caller's transaction exists (an enqueue in it), not for a transaction pgonce owns (the relay's
claim of a batch, on a node that takes no writes), where there is no caller to end anything."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pgonce.errors import DatabaseUnavailable
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.test_probe_relay_pooled_listen import Acking


def test_an_enqueue_in_the_callers_read_only_transaction_says_to_end_it(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SET TRANSACTION READ ONLY")
        with pytest.raises(DatabaseUnavailable) as raised:
            enqueue(conn, "order", "1", "e", {})
    assert "or end the caller's read-only transaction" in str(raised.value)


async def test_the_relays_claim_on_a_read_only_node_names_no_callers_transaction(
    direct_dsn: str,
) -> None:
    read_only = make_conninfo(direct_dsn, options="-c default_transaction_read_only=on")
    with psycopg.connect(direct_dsn) as conn:
        enqueue(conn, "order", "1", "e", {})
        conn.commit()
    relay = Relay(read_only, Acking(), listen=False)
    async with await relay.connect(read_only) as conn:
        with pytest.raises(DatabaseUnavailable) as raised:
            await relay.run_once(conn)
    assert "takes no writes" in str(raised.value)
    assert "caller" not in str(raised.value)
