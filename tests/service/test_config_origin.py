"""A problem with a value a ``PGONCE__SECTION__KEY`` variable set names that variable, not the file:
the operator otherwise searches the file for a key it does not hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgonce.errors import ConfigError
from pgonce.service.config import load


def problems(tmp_path: Path, text: str, environ: dict[str, str]) -> str:
    path = tmp_path / "pgonce.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load(path, environ)
    return str(caught.value)


def test_a_bad_override_is_blamed_on_its_variable(tmp_path: Path) -> None:
    message = problems(tmp_path, "[server]\nport = 8000\n", {"PGONCE__SERVER__PORT": "abc"})
    assert "PGONCE__SERVER__PORT: server.port: must be a whole number" in message
    assert "pgonce.toml: server.port" not in message


def test_an_unknown_override_is_blamed_on_its_variable(tmp_path: Path) -> None:
    message = problems(tmp_path, "", {"PGONCE__SERVR__PORT": "9000"})
    assert "PGONCE__SERVR__PORT: servr: is not a known setting" in message


def test_a_bad_key_of_the_file_is_still_the_files(tmp_path: Path) -> None:
    message = problems(tmp_path, "[server]\nport = 99999\n", {"PGONCE__SERVER__HOST": "127.0.0.1"})
    assert "pgonce.toml: server.port: must be a whole number" in message
