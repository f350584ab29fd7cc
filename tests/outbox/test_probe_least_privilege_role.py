"""pgonce's runtime on a role that owns nothing: USAGE on pgonce's schema, SELECT, INSERT, UPDATE
and DELETE on its tables, USAGE on its sequences, and no CREATE anywhere (PostgreSQL 15's public
schema, and here no CREATE on it at all). What the migration created stays the migrating role's;
the application's role claims keys in its own transaction and with ``commit=True``, enqueues,
relays with LISTEN, consumes, receives and handles webhooks, each effect once."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from redis.asyncio import Redis

from pgonce import KeyStore, Response, enqueue, fingerprint
from pgonce.consumers import IdempotentConsumer, Outcome
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from pgonce.webhooks.worker import InboxWorker

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture
def app_dsn(dsn: str, server_dsn: str) -> Iterator[str]:
    """The test database reached as a new role with the privileges an application is given."""
    name = f"pgonce_app_{uuid.uuid4().hex[:12]}"  # needs no quoting
    role = sql.Identifier(name)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
        for grant in (
            "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
            "GRANT USAGE ON SCHEMA pgonce TO {}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA pgonce TO {}",
            "GRANT USAGE ON ALL SEQUENCES IN SCHEMA pgonce TO {}",
            "CREATE TABLE public.effects (what text)",
            "GRANT SELECT, INSERT ON public.effects TO {}",
        ):
            admin.execute(sql.SQL(grant).format(role))
    try:
        yield make_conninfo(dsn, user=name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(role))
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(role))


def effects(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT what FROM effects ORDER BY what")]


async def test_an_application_role_without_create_runs_every_part(
    dsn: str, app_dsn: str, redis_url: str
) -> None:
    store = KeyStore()
    kind = f"order-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT has_schema_privilege('public', 'CREATE')").fetchone() == (
            False,
        )
        for _ in range(2):
            with conn.transaction(), store.once(conn, "s", "joined", fingerprint(b"j")) as op:
                if op.won:
                    conn.execute("INSERT INTO effects VALUES ('joined')")
                    enqueue(conn, kind, "42", "order.created", {"id": 42})
                    op.respond(Response(201))
            with store.once(conn, "s", "owned", fingerprint(b"o"), commit=True) as owned:
                if owned.won:
                    owned.execute("INSERT INTO effects VALUES ('owned')")
                    owned.respond(Response(201))

    stats = await Relay(app_dsn, RedisStreamsPublisher(redis_url)).drain()
    redis = Redis.from_url(redis_url)
    try:
        entries = await redis.xrange(f"outbox.{kind}")
        await redis.delete(f"outbox.{kind}")
    finally:
        await redis.aclose()
    assert entries is not None
    assert (stats.published, stats.errors, len(entries)) == (1, 0, 1), stats.last_error

    async def consume(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES ('consumed')")

    async def handle(event: Any, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES ('handled')")

    consumer = IdempotentConsumer("shipping")
    scheme = build_scheme("standard-webhooks", [SECRET])
    source = Source(name="shop", scheme=scheme, handler=handle)
    body = b'{"type": "order.paid"}'
    async with InboxReceiver([source], dsn=app_dsn) as receiver:
        transport = httpx.ASGITransport(app=receiver)
        async with httpx.AsyncClient(transport=transport, base_url="http://hooks") as client:
            answers = [
                (
                    await client.post(
                        "/webhooks/shop",
                        content=body,
                        headers=scheme.sign(body, event_id="m1"),
                    )
                ).json()
                for _ in range(2)
            ]
    assert answers == [{"outcome": "stored"}, {"outcome": "duplicate"}]
    async with await psycopg.AsyncConnection.connect(app_dsn, autocommit=True) as aconn:
        outcomes = [await consumer.handle(aconn, "17", b"{}", consume) for _ in range(2)]
        worker = InboxWorker([source], dsn=app_dsn)
        first, again = await worker.run_once(aconn), await worker.run_once(aconn)
    assert outcomes == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert (first.done, again.claimed) == (1, 0)
    assert effects(dsn) == ["consumed", "handled", "joined", "owned"]
