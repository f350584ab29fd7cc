"""The settings this issue added, read from the file and the environment as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgonce.config import Settings, own_connect_kwargs
from pgonce.errors import ConfigError
from pgonce.service.config import load


def test_outbox_declare_and_require_dsn_are_read_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text(
        '[database]\nrequire_dsn = true\n[outbox]\npublisher = "rabbitmq"\ndeclare = true\n'
    )
    config = load(path, environ={})
    assert config.settings.require_dsn
    assert config.outbox is not None
    assert config.outbox.declare


def test_false_in_the_file_does_not_lift_the_hosts_guard(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text("[database]\nrequire_dsn = false\n")
    assert load(path, environ={"PGONCE_REQUIRE_DSN": "1"}).settings.require_dsn


def test_the_guard_from_the_environment_is_checked() -> None:
    assert Settings.from_env({"PGONCE_REQUIRE_DSN": "yes"}).require_dsn
    assert not Settings.from_env({}).require_dsn
    with pytest.raises(ConfigError, match="PGONCE_REQUIRE_DSN must be 1 or 0"):
        Settings.from_env({"PGONCE_REQUIRE_DSN": "always"})


def test_an_empty_dsn_variable_is_an_error_unless_a_dsn_is_given() -> None:
    with pytest.raises(ConfigError, match="PGONCE_DSN is set but empty"):
        Settings.from_env({"PGONCE_DSN": " "})
    assert Settings.from_env({"PGONCE_DSN": ""}, dsn="postgresql://h/db").dsn == "postgresql://h/db"


def test_connections_pgonce_opens_itself_ignore_the_dsn_variables() -> None:
    """A worker or relay given its connection reads only the pooler's settings from the
    environment: an empty PGONCE_DSN or the DSN guard is not its concern."""
    environ = {
        "PGONCE_DSN": "",
        "PGONCE_REQUIRE_DSN": "1",
        "PGONCE_POOLER": "pgbouncer-transaction",
        "PGONCE_PREPARE_THRESHOLD": "3",
    }
    assert own_connect_kwargs(environ=environ) == {"prepare_threshold": None}
    assert own_connect_kwargs({"prepare_threshold": 7}, environ={"PGONCE_DSN": ""}) == {
        "prepare_threshold": 7
    }
    assert own_connect_kwargs(environ={"PGONCE_PREPARE_THRESHOLD": "3"}) == {"prepare_threshold": 3}
    with pytest.raises(ConfigError, match="pooler 'pgbouncer' is not known"):
        own_connect_kwargs(environ={"PGONCE_POOLER": "pgbouncer"})
