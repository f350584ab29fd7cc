"""The outbox relay behind PgBouncer in ``pool_mode = statement``, and behind a PgBouncer that is
killed, restarted or told to drop its server connections while the relay runs.

Every batch is a transaction, which statement mode refuses at its BEGIN. The relay used to say
"the database still fails", as for an outage, and wait for it to end: the operator looked for a
database that was down, when it is the pool mode that has to change. A claim of the key store
meeting the same refusal raises a ConfigError that names the pool modes that work; the relay now
says the same, and goes on trying (the pooler may be reconfigured without restarting the relay).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import psycopg
import pytest

from pgonce import KeyStore, Response, Won, fingerprint
from pgonce.errors import DatabaseUnavailable
from pgonce.relay import Relay
from tests.outbox.conftest import wait_until
from tests.outbox.test_probe_relay_pooled_listen import Acking
from tests.pgbouncer import admin, started_pgbouncer, through

FP = fingerprint("pooled")


def _database(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


async def test_a_relay_behind_statement_pooling_names_the_pool_modes_that_work(
    direct_dsn: str, server_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    with started_pgbouncer(server_dsn, pool_size=2, pool_mode="statement") as bouncer:
        relay = Relay(
            through(bouncer, direct_dsn),
            Acking(),
            concurrency=1,
            listen_dsn=direct_dsn,
            outage_backoff=(timedelta(milliseconds=50), timedelta(milliseconds=100)),
        )
        stop = asyncio.Event()
        running = asyncio.create_task(relay.run(stop))
        try:
            await wait_until(lambda: relay.stats.errors >= 4, within=30)
        finally:
            stop.set()
            await running
    said = [r for r in caplog.records if "statement pooling mode" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]  # once for the run of failures
    assert "pool_mode = transaction" in said[0].getMessage()
    assert "the database" not in said[0].getMessage()
    assert "tries again" in said[0].getMessage()


@pytest.mark.parametrize("how", ["KILL", "restart"])
def test_a_claim_open_when_pgbouncer_drops_its_connection_frees_the_key(
    direct_dsn: str, server_dsn: str, how: str
) -> None:
    # The server session is closed under the open transaction: it rolled back, so the client
    # gets DatabaseUnavailable (a 503 that it retries) and its retry wins the key once.
    store = KeyStore()
    with started_pgbouncer(server_dsn, pool_size=2) as bouncer:
        dsn = through(bouncer, direct_dsn)
        with psycopg.connect(dsn, prepare_threshold=None) as conn:
            claim = store.begin(conn, "s", "k", FP)
            assert isinstance(claim, Won)
            if how == "KILL":
                admin(bouncer, f"KILL {_database(direct_dsn)}")
            else:
                bouncer.stop()
                bouncer.start()
            with pytest.raises(DatabaseUnavailable):
                store.commit(conn, claim, Response(201))
        if how == "KILL":
            admin(bouncer, f"RESUME {_database(direct_dsn)}")
        with psycopg.connect(dsn, prepare_threshold=None) as conn:
            retry = store.begin(conn, "s", "k", FP)
            assert isinstance(retry, Won)
            assert store.commit(conn, retry, Response(201))
