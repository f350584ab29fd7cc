"""The service's configuration: defaults, environment overrides, every problem listed at once."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from pgonce.errors import ConfigError
from pgonce.service.config import json_pointer, load

SECRET = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
ENV = {"SHOP_SECRET": SECRET, "ADMIN_TOKEN": "t0ken"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pgonce.toml"
    path.write_text(text)
    return path


GOOD = """
[server]
port = 9001
[keys]
retention = "10d"
retry_horizon = "1d"
[admin]
token = "env:ADMIN_TOKEN"
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:SHOP_SECRET"]
handler = "pgonce.service.demo:record_order"
ordering_key = "/data/order"
retention = "30d"
retry_horizon = "72h"
attempts = 3
"""


def test_a_good_file(tmp_path: Path) -> None:
    config = load(write(tmp_path, GOOD), ENV)
    assert config.port == 9001
    assert config.keys_retention.keep == timedelta(days=10)
    assert config.admin_token == "t0ken"
    [shop] = config.sources
    assert shop.source.name == "shop"
    assert shop.source.retry.attempts == 3
    assert shop.retention.retry_horizon == timedelta(hours=72)
    assert shop.source.handler is not None
    assert "t0ken" not in repr(config)


def test_no_file_means_defaults(tmp_path: Path) -> None:
    config = load(None, {})
    assert (config.host, config.port, config.sources) == ("127.0.0.1", 8000, ())
    assert config.origin == "environment"


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    env = {**ENV, "PGONCE__SERVER__PORT": "9100", "PGONCE__SOURCES__SHOP__ATTEMPTS": "7"}
    config = load(write(tmp_path, GOOD), env)
    assert config.port == 9100
    assert config.sources[0].source.retry.attempts == 7


def test_every_problem_is_listed_with_file_and_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[server]
port = "eighty"
colour = "blue"
[sources.shop]
scheme = "carrier-pigeon"
secrets = ["whsec_pasted_the_secret_itself"]
handler = "no.such.module:handler"
[sources.gh]
scheme = "github"
secrets = "env:UNSET_VARIABLE"
tolerance = "soon"
""",
    )
    with pytest.raises(ConfigError) as caught:
        load(path, {})
    message = str(caught.value)
    assert f"{path}: server.port: must be a whole number" in message
    assert f"{path}: server.colour: is not a known setting" in message
    assert "sources.shop.scheme: unknown scheme" in message
    assert 'sources.shop.secrets: secrets are given by reference: write "env:NAME"' in message
    assert "whsec_pasted_the_secret_itself" not in message
    assert "sources.shop.handler: cannot import 'no.such.module'" in message
    assert "sources.gh.secrets: the environment variable UNSET_VARIABLE is not set" in message
    assert "sources.gh.tolerance" in message
    assert message.startswith("the configuration has 7 problems")


def test_retention_shorter_than_the_retry_horizon_is_refused(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[sources.stripe]
scheme = "stripe"
secrets = "env:SHOP_SECRET"
retention = "2d"
retry_horizon = "3d"
""",
    )
    with pytest.raises(
        ConfigError,
        match=r"sources\.stripe\.retention: 2d is shorter than the "
        r"provider's retry horizon of 3d",
    ):
        load(path, ENV)


def test_broker_url_with_a_password_must_come_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, '[outbox]\npublisher = "rabbitmq"\nurl = "amqp://me:hunter2@mq/"\n')
    with pytest.raises(ConfigError, match="holds a login") as caught:
        load(path, {})
    assert "hunter2" not in str(caught.value)


def test_the_database_commands_read_the_file_without_the_services_secrets(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        GOOD
        + '[sources.empty]\nscheme = "stripe"\nsecrets = []\n'
        + '[outbox]\npublisher = "rabbitmq"\nurl = "env:BROKER_URL"\n',
    )
    # pgonce serve needs every secret the file names, and says which are missing.
    with pytest.raises(ConfigError) as caught:
        load(path, {})
    for missing in ("ADMIN_TOKEN", "SHOP_SECRET", "BROKER_URL"):
        assert f"the environment variable {missing} is not set" in str(caught.value)
    # migrate, sweep, doctor, replay and events need none of them, and keep the retention.
    config = load(path, {}, secrets=False)
    assert (config.sources, config.admin_token, config.outbox and config.outbox.url) == (
        (),
        None,
        "",
    )
    [_, inbox, _] = config.retention_policies()
    assert inbox.scopes["shop"].keep == timedelta(days=30)
    # A source with no secret at all is still refused by serve, never left out quietly.
    with pytest.raises(ConfigError, match=r"sources\.empty"):
        load(path, {**ENV, "BROKER_URL": "amqp://mq/"})
    # The DSN is read either way, and a secret written in the file is still refused.
    with pytest.raises(ConfigError, match="PG_DSN is not set"):
        load(write(tmp_path, '[database]\ndsn = "env:PG_DSN"\n'), {}, secrets=False)
    with pytest.raises(ConfigError, match="by reference") as written:
        load(write(tmp_path, '[admin]\ntoken = "hunter2"\n'), {}, secrets=False)
    assert "hunter2" not in str(written.value)


def test_unreadable_files_are_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such configuration file"):
        load(tmp_path / "missing.toml", {})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(write(tmp_path, "[server\nport = 1"), {})


def test_json_pointer() -> None:
    get = json_pointer("/data/items/1/id")
    assert get({"data": {"items": [{"id": 1}, {"id": 2}]}}) == 2
    assert get({"data": {}}) is None
    assert json_pointer("/a~1b/c~0d")({"a/b": {"c~d": 3}}) == 3
    with pytest.raises(ConfigError, match="not a JSON pointer"):
        json_pointer("data/id")


def test_the_relays_rabbitmq_max_message_size_is_a_setting(tmp_path: Path) -> None:
    from pgonce.service.runner import build_publisher

    path = write(tmp_path, '[outbox]\npublisher = "rabbitmq"\nmax_message_size = 16777216\n')
    publisher = build_publisher(load(path, {}))
    assert publisher.max_message_size == 16 * 1024 * 1024  # type: ignore[attr-defined]
    for bad in ("0", "536870913", '"16MiB"'):
        path = write(tmp_path, f'[outbox]\npublisher = "rabbitmq"\nmax_message_size = {bad}\n')
        with pytest.raises(ConfigError, match="max_message_size"):
            load(path, {})
