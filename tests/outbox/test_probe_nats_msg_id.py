"""Two outboxes publishing into one JetStream stream keep every event, with or without a prefix.

JetStream deduplicates by ``Nats-Msg-Id`` inside the stream's duplicate window, and acknowledges
the second message with an id it stored as a duplicate. The outbox id is unique within one outbox
only: two outboxes (two databases, two schemas, two deployments) both have a row 1, and the second
one's event was acknowledged and marked published though the stream never stored it. The relay
now gives the publisher the outbox's origin (a hash of the cluster's system identifier, the
database and the schema), which ``Nats-Msg-Id`` starts with; a ``msg_id_prefix`` replaces it. A
row published again, by the same relay or another, still carries the same id, which the stream
drops.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pgonce.errors import ConfigError, UsageError
from pgonce.publishers.base import outbox_origin
from pgonce.publishers.nats import NatsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from pgonce.store.migrate import migrate
from tests.outbox.brokers import nats_read, nats_stream
from tests.outbox.conftest import fresh, outbox_rows

#: The second pgonce schema in the test's database: a second outbox, numbered from 1 too.
OTHER = "pgonce_other"


async def publish_both(
    nats_url: str, first: NatsPublisher, second: NatsPublisher, subject: str
) -> list[tuple[str, int]]:
    """Row 1 of each outbox (payloads 1 and 2), each published twice; what the stream holds."""
    stream = fresh("PGONCE_TEST_")
    async with nats_stream(nats_url, stream, [subject]) as js:
        try:
            for publisher, n in ((first, 1), (second, 2)):
                (row,) = outbox_rows(1)
                row = row._replace(payload_json=json.dumps({"n": n}))
                for _ in range(2):
                    result = await publisher.publish([row])
                    assert result.acked == {1}
                    assert not result.refused
                    assert result.lost is None
        finally:
            await first.close()
            await second.close()
        return [(r.dedupe_id, json.loads(r.body)["n"]) for r in await nats_read(js, stream)]


async def test_two_outboxes_with_their_own_prefix_both_reach_one_stream(nats_url: str) -> None:
    subject = fresh("pgonce.test.")
    stored = await publish_both(
        nats_url,
        NatsPublisher(nats_url, routing=lambda m: subject, msg_id_prefix="billing:"),
        NatsPublisher(nats_url, routing=lambda m: subject, msg_id_prefix="shipping:"),
        subject,
    )
    # Each outbox's row once: its redelivery was dropped as a duplicate, the other's was not.
    assert stored == [("billing:1", 1), ("shipping:1", 2)]


async def test_a_prefix_replaces_the_origin_the_relay_gives(nats_url: str) -> None:
    subject = fresh("pgonce.test.")
    first = NatsPublisher(nats_url, routing=lambda m: subject, msg_id_prefix="billing:")
    second = NatsPublisher(nats_url, routing=lambda m: subject, msg_id_prefix="shipping:")
    first.set_origin("0123456789ab")
    second.set_origin("0123456789ab")
    stored = await publish_both(nats_url, first, second, subject)
    assert stored == [("billing:1", 1), ("shipping:1", 2)]


@pytest.fixture
def two_outboxes(direct_dsn: str) -> Iterator[str]:
    """The test's database with a second pgonce schema beside ``pgonce``."""
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        migrate(conn, OTHER)
    try:
        yield direct_dsn
    finally:
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(OTHER)))


def enqueue_in(dsn: str, schema: str, n: int) -> int:
    with psycopg.connect(dsn) as conn:
        return enqueue(conn, "order", "1", "order.created", {"n": n}, schema=schema)


def republish(dsn: str, schema: str, row: int) -> None:
    """What a relay that published the row and died before marking it leaves behind."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {}.outbox SET published_at = NULL WHERE id = %s").format(
                sql.Identifier(schema)
            ),
            (row,),
        )


async def drain(dsn: str, schema: str, nats_url: str, subject: str) -> int:
    """Publish the outbox of ``schema`` with a relay of its own and a publisher without a prefix;
    the rows it marked published."""
    relay = Relay(dsn, NatsPublisher(nats_url, routing=lambda m: subject), schema=schema)
    try:
        return (await relay.drain()).published
    finally:
        await relay.publisher.close()


def origin_of(dsn: str, schema: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT system_identifier::text, current_database() FROM pg_control_system()"
        ).fetchone()
    assert row is not None
    return outbox_origin(row[0], row[1], schema)


async def test_two_outboxes_without_a_prefix_both_reach_one_stream(
    two_outboxes: str, nats_url: str
) -> None:
    dsn = two_outboxes
    # Both outboxes number their rows from 1: the ids alone collide.
    first, second = enqueue_in(dsn, "pgonce", 1), enqueue_in(dsn, OTHER, 2)
    assert first == second
    subject = fresh("pgonce.test.")
    stream = fresh("PGONCE_TEST_")
    async with nats_stream(nats_url, stream, [subject]) as js:
        assert await drain(dsn, "pgonce", nats_url, subject) == 1
        assert await drain(dsn, OTHER, nats_url, subject) == 1
        # The first outbox's row again, by another relay, as after a crash before the mark:
        # acknowledged, and dropped by the stream as the duplicate it is.
        republish(dsn, "pgonce", first)
        assert await drain(dsn, "pgonce", nats_url, subject) == 1
        stored = await nats_read(js, stream)
    assert [(r.message_id, r.payload["n"]) for r in stored] == [(str(first), 1), (str(second), 2)]
    ids = [r.dedupe_id for r in stored]
    assert ids == [f"{origin_of(dsn, 'pgonce')}:{first}", f"{origin_of(dsn, OTHER)}:{second}"]
    assert all(re.fullmatch(r"[0-9a-f]{12}:[0-9]+", i) for i in ids)


@pytest.fixture
def plain_role_dsn(direct_dsn: str, server_dsn: str) -> Iterator[str]:
    """The test's database reached as a role with only the outbox's privileges."""
    name = f"pgonce_app_{uuid.uuid4().hex[:12]}"
    role = sql.Identifier(name)
    with psycopg.connect(direct_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
        for grant in (
            "GRANT USAGE ON SCHEMA pgonce TO {}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA pgonce TO {}",
            "GRANT USAGE ON ALL SEQUENCES IN SCHEMA pgonce TO {}",
        ):
            admin.execute(sql.SQL(grant).format(role))
    try:
        yield make_conninfo(direct_dsn, user=name)
    finally:
        with psycopg.connect(direct_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(role))
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(role))


class Origins:
    """A publisher that keeps the origins the relay gives it and acknowledges every row."""

    name = "origins"

    def __init__(self) -> None:
        self.origins: list[str] = []

    def set_origin(self, origin: str) -> None:
        self.origins.append(origin)

    async def publish(self, batch: Any) -> Any:
        from pgonce.publishers.base import PublishResult

        return PublishResult(acked=frozenset(m.id for m in batch))

    async def close(self) -> None:
        pass


async def test_a_relay_on_a_plain_role_gives_the_same_origin_as_the_owner(
    direct_dsn: str, plain_role_dsn: str
) -> None:
    """The origin is what a relay of the same outbox on any role reads: a least-privilege role
    reads pg_control_system() too, and gets no other origin than the owner's."""
    enqueue_in(direct_dsn, "pgonce", 1)
    publisher = Origins()
    await Relay(plain_role_dsn, publisher).drain()
    assert publisher.origins == [origin_of(direct_dsn, "pgonce")]


@pytest.mark.parametrize("prefix", ["a b:", "a\n", 7])
def test_a_prefix_no_header_can_carry_is_refused(prefix: object) -> None:
    with pytest.raises(ConfigError, match="msg_id_prefix"):
        NatsPublisher(msg_id_prefix=prefix)  # type: ignore[arg-type]


async def test_without_the_control_data_the_origin_names_the_database_and_schema(
    direct_dsn: str, plain_role_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that lets no one read pg_control_system(): the relay still starts, says so, and
    names the outbox by its database and schema."""
    with psycopg.connect(direct_dsn, autocommit=True) as admin:
        # pg_proc is the database's own: the revoke ends with the test's database.
        admin.execute("REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC")
        database = admin.execute("SELECT current_database()").fetchone()
    assert database is not None
    enqueue_in(direct_dsn, "pgonce", 1)
    publisher = Origins()
    stats = await Relay(plain_role_dsn, publisher).drain()
    assert stats.published == 1
    assert publisher.origins == [outbox_origin("", database[0], "pgonce")]
    assert publisher.origins != [origin_of(direct_dsn, "pgonce")]
    assert "the cluster's system identifier cannot be read" in caplog.text


@pytest.mark.parametrize("prefix", ["", "billing:"])
def test_one_publisher_given_to_relays_of_two_outboxes_is_refused(prefix: str) -> None:
    # The second origin took the first's place: one outbox's row 1 and the other's carried
    # one id, and JetStream dropped one of them. With a prefix the ids were one too.
    publisher = NatsPublisher(msg_id_prefix=prefix)
    publisher.set_origin(outbox_origin("1", "app", "pgonce"))
    publisher.set_origin(outbox_origin("1", "app", "pgonce"))  # the same outbox, again
    with pytest.raises(UsageError, match="one NatsPublisher serves one outbox"):
        publisher.set_origin(outbox_origin("1", "app", OTHER))
