"""A Redis URL that redis-py cannot read (a port that is no number or out of range, a query
option of the wrong form) is a config error when the publisher is made, and the message does not
repeat the URL, which may hold a password. It used to pass the check of its scheme and raise a
ValueError out of every batch."""

from __future__ import annotations

import pytest

from pgonce.errors import ConfigError
from pgonce.publishers.redis_streams import RedisStreamsPublisher


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:notaport/0",
        "redis://:s3cret@127.0.0.1:99999/0",
        "redis://:s3cret@127.0.0.1:6379/0?socket_timeout=soon",
        "redis://:s3cret@127.0.0.1:6379/0?health_check_interval=often",
    ],
)
def test_a_url_redis_cannot_read_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="Redis publisher's url") as raised:
        RedisStreamsPublisher(url)
    assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "rediss://u:p@redis.example:6380/2", "unix:///tmp/r.sock"]
)
def test_a_url_redis_can_read_is_taken(url: str) -> None:
    RedisStreamsPublisher(url)


@pytest.mark.parametrize("maxlen", [True, 1.5, "1000"])
def test_a_maxlen_that_is_not_a_whole_number_is_a_config_error(maxlen: object) -> None:
    with pytest.raises(ConfigError, match="maxlen"):
        RedisStreamsPublisher("redis://127.0.0.1:6379/0", maxlen=maxlen)  # type: ignore[arg-type]
