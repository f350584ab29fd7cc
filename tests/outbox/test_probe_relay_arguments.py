"""A relay given a DSN, a publisher or a retry policy of the wrong type refuses it when it is made,
with a config error that names the setting. A DSN of None used to be taken (libpq then connects
wherever its environment points), bytes failed with a bare AttributeError, a publisher class or
None failed every batch later, and a policy of the wrong type failed only at the first refusal,
after the batch was published, so the same rows went to the broker again at every retry."""

from __future__ import annotations

from typing import Any

import pytest

from pgonce.errors import ConfigError
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay

DSN = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.mark.parametrize(
    ("setting", "arguments"),
    [
        ("dsn", {"dsn": None}),
        ("dsn", {"dsn": DSN.encode()}),
        ("listen_dsn", {"listen_dsn": 5432}),
        ("publisher", {"publisher": None}),
        ("publisher", {"publisher": RedisStreamsPublisher}),
        ("publisher", {"publisher": "redis"}),
        ("policy", {"policy": 5}),
        ("policy", {"policy": {"max_attempts": 3}}),
    ],
)
def test_a_setting_of_the_wrong_type_is_a_config_error(
    setting: str, arguments: dict[str, Any]
) -> None:
    given: dict[str, Any] = {"dsn": DSN, "publisher": RedisStreamsPublisher()} | arguments
    with pytest.raises(ConfigError, match=setting):
        Relay(given.pop("dsn"), given.pop("publisher"), **given)


def test_a_publisher_instance_and_the_default_policy_are_taken() -> None:
    relay = Relay(DSN, RedisStreamsPublisher(), listen_dsn=DSN)
    assert relay.publisher.name == "redis"
