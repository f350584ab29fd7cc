"""A NATS server address nats-py can never connect to is refused when the publisher is made, as
the RabbitMQ, Redis and webhook publishers refuse theirs, and `pgonce relay` ends on one line.
Such an address used to be accepted and every batch waited "unavailable", retried for ever:
nats-py took `amqp://guest:s3cret@host:5672` for a host named `amqp`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pgonce.errors import ConfigError
from pgonce.publishers.nats import NatsPublisher

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "servers",
    [
        "amqp://guest:s3cret@127.0.0.1:5672/",
        "redis://:s3cret@127.0.0.1:6379/0",
        "nats://relay:s3cret@127.0.0.1:99999",
        "nats://relay:s3cret@127.0.0.1:notaport",
        "nats://127.0.0.1:4222,nats://127.0.0.1:4223",
        "nats://:4222",
        ["nats://127.0.0.1:4222", "http://relay:s3cret@127.0.0.1:4223"],
        [],
    ],
)
def test_an_address_nats_cannot_use_is_a_config_error(servers: str | list[str]) -> None:
    with pytest.raises(ConfigError, match="NATS publisher's") as raised:
        NatsPublisher(servers)
    assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize(
    "servers",
    [
        "nats://127.0.0.1:4222",
        "127.0.0.1:4222",
        "localhost",
        "tls://relay:pw@nats.example.com",
        "wss://nats.example.com/ws",
        "nats://[::1]:4222",
        ["nats://127.0.0.1:4222", "nats://127.0.0.1:4223"],
    ],
)
def test_the_addresses_nats_connects_with_are_taken(servers: str | list[str]) -> None:
    assert NatsPublisher(servers).servers == servers


def test_the_relay_refuses_the_address_at_its_start(dsn: str, tmp_path: Path) -> None:
    config = tmp_path / "pgonce.toml"
    config.write_text('[outbox]\npublisher = "nats"\nurl = "env:TEST_BROKER_URL"\n')
    result = subprocess.run(
        [sys.executable, "-m", "pgonce", "relay", "--config", str(config), "--dsn", dsn],
        cwd=ROOT,
        env={**os.environ, "TEST_BROKER_URL": "amqp://guest:s3cret@127.0.0.1:5672/"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "pgonce: error: the NATS publisher's url must be a nats://, tls://, ws:// or wss:// URL "
        "with a host and a valid port, not amqp://127.0.0.1:5672"
    )
    assert "s3cret" not in result.stderr + result.stdout
    assert "unavailable" not in result.stderr
