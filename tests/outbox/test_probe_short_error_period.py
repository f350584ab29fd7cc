"""A broker's message that ends with a period (redis-py's "Connection closed by server.") is
shortened without it: the reason is joined with "; " into the relay's lines and a row's
last_error, which read "server.;" before."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError

from pgonce.publishers.base import short_error


def test_a_trailing_period_is_dropped() -> None:
    error = RedisConnectionError("Connection closed by server.")
    assert short_error(error) == "ConnectionError: Connection closed by server"
    joined = f"Redis: {short_error(error)}; the rows wait until it is fixed"
    assert ".;" not in joined


def test_a_message_without_a_period_is_kept() -> None:
    assert short_error(ValueError("bad value\nmore")) == "ValueError: bad value"
    assert short_error(ValueError("")) == "ValueError"
    assert short_error(ValueError("...")) == "ValueError: ..."
