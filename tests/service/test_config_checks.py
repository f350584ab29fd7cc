"""Configuration mistakes refused at load, each naming its key: durations without a unit or not
positive, credentials written in the file, an empty [outbox], a handler module that fails to import,
and the environment's database settings winning over the file's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from pgonce.errors import ConfigError
from pgonce.service.config import load


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pgonce.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[sweeper]\nevery = 0\n", "sweeper.every: must be a duration with its unit"),
        ("[sweeper]\nevery = -5\n", "sweeper.every: must be a duration with its unit"),
        ("[sweeper]\nevery = '0s'\n", "sweeper.every: must be longer than 0s"),
        (
            "[keys]\nretry_horizon = 3\n",
            'keys.retry_horizon: must be a duration with its unit, e.g. "3d',
        ),
        ("[database]\npool_wait = nan\n", "database.pool_wait: must be a duration with its unit"),
        ("[database]\npool_wait = 1e400\n", "database.pool_wait: must be a duration with its unit"),
        (
            "[outbox]\npublisher='nats'\nretention='0s'\n",
            "outbox.retention: must be longer than 0s",
        ),
        (
            "[sweeper]\nevery = '9999999999999d'\n",
            "sweeper.every: '9999999999999d' is too long a duration",
        ),
    ],
)
def test_durations_need_a_unit_and_a_positive_length(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(why)):
        load(write(tmp_path, text), {})


def test_a_zero_retry_horizon_is_allowed(tmp_path: Path) -> None:
    config = load(write(tmp_path, "[keys]\nretry_horizon = '0s'\n"), {})
    assert config.keys_retention.retry_horizon.total_seconds() == 0


@pytest.mark.parametrize(
    "text",
    [
        "[outbox]\npublisher = 'nats'\nurl = 'nats://mytoken123@10.0.0.1:4222'\n",
        "[outbox]\npublisher = 'http'\nurl = 'https://hooks.example/x?token=mytoken123'\n"
        "secret = 'env:S'\n",
        "[sources.fwd]\nscheme = 'standard-webhooks'\nsecrets = ['env:S']\n"
        "forward = 'http://user:mytoken123@host/hook'\n",
        "[sources.fwd]\nscheme = 'standard-webhooks'\nsecrets = ['env:S']\n"
        "forward = 'http://host/hook?token=mytoken123'\n",
    ],
)
def test_credentials_in_a_literal_url_are_refused_unshown(tmp_path: Path, text: str) -> None:
    env = {"S": "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"}
    with pytest.raises(ConfigError, match="env:NAME") as caught:
        load(write(tmp_path, text), env)
    assert "mytoken123" not in str(caught.value)


def test_an_empty_outbox_table_reports_its_missing_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"outbox\.publisher: is one of"):
        load(write(tmp_path, "[outbox]\n"), {})


def test_a_handler_module_that_fails_on_import_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    text = (
        "[sources.shop]\nscheme = 'standard-webhooks'\nsecrets = ['env:S']\n"
        "handler = 'raises_on_import:handle'\n"
    )
    env = {"S": "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"}
    with pytest.raises(ConfigError, match="importing 'raises_on_import' raised RuntimeError"):
        load(write(tmp_path, text), env)
    sys.modules.pop("raises_on_import", None)


def test_the_environment_wins_over_the_files_database_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[database]\ndsn = 'env:FILE_DSN'\nschema = 'from_file'\n")
    env = {
        "FILE_DSN": "postgresql://file@127.0.0.1/file",
        "PGONCE_DSN": "postgresql://env@127.0.0.1/env",
        "PGONCE_SCHEMA": "from_env",
    }
    settings = load(path, env).settings
    assert (settings.dsn, settings.schema) == (env["PGONCE_DSN"], "from_env")
    settings = load(path, {"FILE_DSN": env["FILE_DSN"]}).settings
    assert (settings.dsn, settings.schema) == (env["FILE_DSN"], "from_file")


def test_a_pgonce_variable_may_hold_a_secret_as_it_is(tmp_path: Path) -> None:
    """The reference says PGONCE__DATABASE__DSN overrides [database] dsn: the environment is
    where secrets belong, so its value is taken as it is, not required to be "env:NAME"."""
    path = write(tmp_path, "[outbox]\npublisher = 'rabbitmq'\n")
    env = {
        "PGONCE__DATABASE__DSN": "postgresql://app:s3cret@127.0.0.1/app",
        "PGONCE__OUTBOX__URL": "amqp://relay:s3cret@rabbit:5672/",
    }
    config = load(path, env)
    assert config.settings.dsn == env["PGONCE__DATABASE__DSN"]
    assert config.outbox is not None
    assert config.outbox.url == env["PGONCE__OUTBOX__URL"]
