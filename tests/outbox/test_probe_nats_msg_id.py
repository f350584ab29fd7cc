"""Two outboxes publishing into one JetStream stream keep every event when their ids are apart.

JetStream deduplicates by ``Nats-Msg-Id`` inside the stream's duplicate window, and acknowledges
the second message with an id it stored as a duplicate. The outbox id is unique within one outbox
only: two outboxes (two databases, two schemas, two deployments) both have a row 1, and the second
one's event was acknowledged and marked published though the stream never stored it. The
publisher's ``msg_id_prefix`` puts each outbox's ids apart, and a redelivery of the same row by
the same outbox still carries the same id, which the stream drops.
"""

from __future__ import annotations

import json

import pytest

from pgonce.errors import ConfigError
from pgonce.publishers.nats import NatsPublisher
from tests.outbox.brokers import nats_read, nats_stream
from tests.outbox.conftest import fresh, outbox_rows


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
        return [(r.message_id, json.loads(r.body)["n"]) for r in await nats_read(js, stream)]


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


@pytest.mark.xfail(
    strict=True,
    reason="without msg_id_prefix, Nats-Msg-Id is the bare outbox id: the second outbox's row 1 "
    "is acknowledged as a duplicate and never stored",
)
async def test_two_outboxes_without_a_prefix_both_reach_one_stream(nats_url: str) -> None:
    subject = fresh("pgonce.test.")
    stored = await publish_both(
        nats_url,
        NatsPublisher(nats_url, routing=lambda m: subject),
        NatsPublisher(nats_url, routing=lambda m: subject),
        subject,
    )
    assert sorted(n for _, n in stored) == [1, 2]


@pytest.mark.parametrize("prefix", ["a b:", "a\n", 7])
def test_a_prefix_no_header_can_carry_is_refused(prefix: object) -> None:
    with pytest.raises(ConfigError, match="msg_id_prefix"):
        NatsPublisher(msg_id_prefix=prefix)  # type: ignore[arg-type]
