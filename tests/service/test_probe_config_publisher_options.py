"""An [outbox] option of another publisher is a configuration problem, not silently ignored:
`exchange = "billing"` with the redis or nats publisher sent every event to `outbox.<type>`
while the file said otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgonce.errors import ConfigError
from pgonce.service.config import load

SECRET = {"HOOK_SECRET": "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"}


@pytest.mark.parametrize(
    ("publisher", "option", "owner"),
    [
        ("redis", 'exchange = "billing"', "rabbitmq"),
        ("nats", 'exchange = "billing"', "rabbitmq"),
        ("nats", "declare = true", "rabbitmq"),
        ("redis", "max_message_size = 1048576", "rabbitmq"),
        ("rabbitmq", 'secret = "env:HOOK_SECRET"', "http"),
        ("redis", 'secret = "env:HOOK_SECRET"', "http"),
    ],
)
def test_an_option_of_another_publisher_is_refused(
    tmp_path: Path, publisher: str, option: str, owner: str
) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text(f'[outbox]\npublisher = "{publisher}"\n{option}\n')
    with pytest.raises(ConfigError) as raised:
        load(path, SECRET)
    name = option.split(" ")[0]
    assert (
        f"outbox.{name}: is an option of the {owner} publisher, not of {publisher}: remove it"
    ) in str(raised.value)
    assert "1 problem" in str(raised.value)
    assert SECRET["HOOK_SECRET"] not in str(raised.value)


def test_an_option_of_another_publisher_set_by_the_environment_names_its_variable() -> None:
    environ = {"PGONCE__OUTBOX__PUBLISHER": "nats", "PGONCE__OUTBOX__EXCHANGE": "billing"}
    with pytest.raises(ConfigError, match=r"PGONCE__OUTBOX__EXCHANGE: outbox\.exchange: is an"):
        load(None, environ)


def test_each_publisher_keeps_its_own_options(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text(
        '[outbox]\npublisher = "rabbitmq"\nexchange = "billing"\ndeclare = true\n'
        "max_message_size = 1048576\n"
    )
    outbox = load(path, {}).outbox
    assert outbox is not None
    assert (outbox.exchange, outbox.declare, outbox.max_message_size) == ("billing", True, 2**20)
    path.write_text(
        '[outbox]\npublisher = "http"\nurl = "https://example.com/hooks"\n'
        'secret = "env:HOOK_SECRET"\n'
    )
    outbox = load(path, SECRET).outbox
    assert outbox is not None
    assert outbox.secret == SECRET["HOOK_SECRET"]
