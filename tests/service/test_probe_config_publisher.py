"""An unknown outbox publisher is one problem, not also a missing URL "for the http publisher"
that the file never asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgonce.errors import ConfigError
from pgonce.service.config import load


def test_an_unknown_publisher_is_not_taken_for_http(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text('[outbox]\npublisher = "kafka"\n')
    with pytest.raises(ConfigError) as raised:
        load(path, {})
    message = str(raised.value)
    assert "outbox.publisher: is one of rabbitmq, nats, redis, http" in message
    assert "http publisher" not in message
    assert "1 problem" in message


def test_the_http_publisher_still_needs_its_url(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text('[outbox]\npublisher = "http"\nsecret = "env:HOOK_SECRET"\n')
    with pytest.raises(ConfigError, match=r"outbox\.url: is required for the http publisher"):
        load(path, {"HOOK_SECRET": "s"})
