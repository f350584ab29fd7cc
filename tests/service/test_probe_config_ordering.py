"""A source's ordering settings are judged in the file: a version pointer with no ordering key
orders nothing, and is refused instead of being dropped in silence."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgonce.errors import ConfigError
from pgonce.service.config import load

ENV = {"SHOP_SECRET": "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"}
SOURCE = """
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:SHOP_SECRET"]
handler = "pgonce.service.demo:record_order"
"""


def test_an_ordering_version_without_an_ordering_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text(SOURCE + 'ordering_version = "/data/version"\n')
    with pytest.raises(ConfigError) as refused:
        load(path, ENV)
    assert "sources.shop.ordering_version" in str(refused.value)
    assert "ordering_key" in str(refused.value)


def test_an_ordering_version_with_its_key_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text(SOURCE + 'ordering_key = "/data/order"\nordering_version = "/data/version"\n')
    (shop,) = load(path, ENV).sources
    assert shop.source.ordering is not None
