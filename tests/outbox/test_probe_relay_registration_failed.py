"""A relay loop whose registration as a waiting relay (outbox_waiting_relays) fails.

The loop registers between batches, when it found fewer rows than a batch holds; no batch is in
progress then. Its failure used to be logged with "the batch's rows were not marked and wait", a
batch that did not exist; the line now says what failed and what happens next.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import psycopg
import pytest

from pgonce.relay import Relay
from tests.outbox.conftest import wait_until
from tests.outbox.test_probe_relay_pooled_listen import Acking


async def test_a_failed_registration_as_waiting_names_no_batch(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        # A real refusal by the server, at every registration.
        conn.execute(
            "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'registrations refused'; END $$"
        )
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON pgonce.outbox_waiting_relays "
            "FOR EACH ROW EXECUTE FUNCTION public.refuse()"
        )
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    relay = Relay(
        direct_dsn,
        Acking(),
        concurrency=1,
        outage_backoff=(timedelta(milliseconds=20), timedelta(milliseconds=40)),
    )
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(lambda: relay.stats.errors >= 3, within=30)
    finally:
        stop.set()
        await running
    said = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "registrations refused" in r.getMessage()
    ]
    assert len(said) == 1, said  # once for the run of failures
    assert "registering a waiting relay" in said[0]
    assert "rows were not marked" not in said[0], said[0]
    assert "no batch was in progress" in said[0]
    assert "tries again in" in said[0]
