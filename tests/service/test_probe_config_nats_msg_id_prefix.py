"""`pgonce serve` sets the NATS publisher's msg_id_prefix from [outbox] msg_id_prefix.

The service built its NATS publisher from the URL alone: an operator who gives each outbox
publishing into one stream a prefix of its own (the ids of outboxes whose origin is not apart, or
ids kept the same across a move to another cluster) had no way to say it in the file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pgonce.errors import ConfigError
from pgonce.publishers.nats import NatsPublisher
from pgonce.service.config import load
from pgonce.service.runner import build_publisher


def test_the_prefix_reaches_the_nats_publisher(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text('[outbox]\npublisher = "nats"\nmsg_id_prefix = "billing:"\n')
    publisher = build_publisher(load(path, {}))
    assert isinstance(publisher, NatsPublisher)
    assert publisher.msg_id_prefix == "billing:"


def test_the_prefix_set_by_the_environment_reaches_the_nats_publisher() -> None:
    environ = {"PGONCE__OUTBOX__PUBLISHER": "nats", "PGONCE__OUTBOX__MSG_ID_PREFIX": "eu-1/"}
    publisher = build_publisher(load(None, environ))
    assert isinstance(publisher, NatsPublisher)
    assert publisher.msg_id_prefix == "eu-1/"


def test_without_a_prefix_the_nats_publisher_takes_the_outbox_origin(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text('[outbox]\npublisher = "nats"\n')
    publisher = build_publisher(load(path, {}))
    assert isinstance(publisher, NatsPublisher)
    assert publisher.msg_id_prefix == ""


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ('"billing outbox:"', "must be a string without spaces or control characters"),
        ('"a\\tb"', "must be a string without spaces or control characters"),
        ("7", "must be a non-empty string"),
        ('""', "must be a non-empty string"),
    ],
)
def test_a_prefix_no_header_can_carry_is_refused(tmp_path: Path, value: str, problem: str) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text(f'[outbox]\npublisher = "nats"\nmsg_id_prefix = {value}\n')
    with pytest.raises(ConfigError) as raised:
        load(path, {})
    assert f"outbox.msg_id_prefix: {problem}" in str(raised.value)
    assert "1 problem" in str(raised.value)


@pytest.mark.parametrize("publisher", ["rabbitmq", "redis"])
def test_the_prefix_is_an_option_of_the_nats_publisher_only(tmp_path: Path, publisher: str) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text(f'[outbox]\npublisher = "{publisher}"\nmsg_id_prefix = "billing:"\n')
    with pytest.raises(ConfigError) as raised:
        load(path, {})
    assert (
        f"outbox.msg_id_prefix: is an option of the nats publisher, not of {publisher}: remove it"
    ) in str(raised.value)
    assert "1 problem" in str(raised.value)
