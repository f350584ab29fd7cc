"""A publisher's timeout given as a number of seconds, or anything but a timedelta, is a config
error when the publisher is made. It used to escape as a bare TypeError from a comparison
(``'>' not supported between instances of 'int' and 'datetime.timedelta'``)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from pgonce.errors import ConfigError

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def http(timeout: Any) -> object:
    from pgonce.publishers.http import HttpPublisher

    return HttpPublisher(secret=SECRET, url="http://127.0.0.1:9/hook", timeout=timeout)


def redis(timeout: Any) -> object:
    from pgonce.publishers.redis_streams import RedisStreamsPublisher

    return RedisStreamsPublisher("redis://127.0.0.1:6379/0", timeout=timeout)


def nats(timeout: Any) -> object:
    from pgonce.publishers.nats import NatsPublisher

    return NatsPublisher("nats://127.0.0.1:4222", ack_timeout=timeout)


def rabbitmq(timeout: Any) -> object:
    from pgonce.publishers.rabbitmq import RabbitMQPublisher

    return RabbitMQPublisher("amqp://guest:guest@127.0.0.1:5672/", confirm_timeout=timeout)


MAKERS = [http, redis, nats, rabbitmq]


@pytest.mark.parametrize("make", MAKERS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("timeout", [5, 2.5, "5s", None])
def test_a_timeout_that_is_not_a_timedelta_is_a_config_error(
    make: Callable[[Any], object], timeout: Any
) -> None:
    with pytest.raises(ConfigError, match="timedelta"):
        make(timeout)


@pytest.mark.parametrize("make", MAKERS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("timeout", [timedelta(0), timedelta(seconds=-1)])
def test_a_timeout_of_nothing_stays_a_config_error(
    make: Callable[[Any], object], timeout: timedelta
) -> None:
    with pytest.raises(ConfigError, match="above 0"):
        make(timeout)


@pytest.mark.parametrize("make", MAKERS, ids=lambda m: m.__name__)
def test_a_timedelta_is_taken(make: Callable[[Any], object]) -> None:
    make(timedelta(seconds=3))
