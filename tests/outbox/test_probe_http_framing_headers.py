"""An outbox row whose headers name one HTTP sets itself for the request's framing or address
(Content-Length, Transfer-Encoding, Host) is refused by the webhook publisher, saying which, while
the rest of the batch is delivered. Content-Length used to raise h11's LocalProtocolError out of the
batch (every batch holding the row failed, the others' answers lost and sent again); the other two
reached the receiver with a body framed otherwise than it was signed, or with another host."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.http import HttpPublisher
from tests.outbox.conftest import Receiver

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def message(row_id: int, headers: dict[str, str]) -> OutboxMessage:
    return OutboxMessage(
        row_id, "order", str(row_id), "created", '{"n": 1}', headers, datetime.now(UTC), 0
    )


@pytest.mark.parametrize(
    "header",
    [
        {"Content-Length": "3"},
        {"content-length": "999"},
        {"Transfer-Encoding": "chunked"},
        {"Host": "other.example"},
    ],
)
async def test_a_framing_header_refuses_its_row_and_the_rest_is_delivered(
    receiver: Receiver, header: dict[str, str]
) -> None:
    publisher = HttpPublisher(url=receiver.url, secret=SECRET)
    try:
        result = await publisher.publish(
            [message(1, {}), message(2, {"traceparent": "00-1-2-01", **header}), message(3, {})]
        )
    finally:
        await publisher.close()
    assert result.acked == {1, 3}
    (name,) = header
    assert set(result.refused) == {2}
    assert f"header {name!r}" in result.refused[2]
    assert len(receiver.requests) == 2
