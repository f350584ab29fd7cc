"""The sweeper's and the completer's intervals have a floor: "1ms" (a slip for "1m") ran a
sweep, each of its batches a transaction and a log line, dozens of times a second."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from pgonce.errors import ConfigError
from pgonce.service.config import load

COMPLETER = '[completer]\noperations = {charge = "pgonce.service.demo:record_order"}\n'


def test_sub_second_intervals_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text('[sweeper]\nevery = "1ms"\n' + COMPLETER + 'every = "250ms"\n')
    with pytest.raises(ConfigError) as refused:
        load(path, {})
    text = str(refused.value)
    assert "sweeper.every: must be at least 1s" in text
    assert "completer.every: must be at least 1s" in text


def test_an_interval_of_a_second_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text('[sweeper]\nevery = "1s"\n' + COMPLETER + 'every = "1s"\n')
    config = load(path, {})
    assert config.sweep_every == timedelta(seconds=1)
    assert config.completer is not None
    assert config.completer.every == timedelta(seconds=1)
