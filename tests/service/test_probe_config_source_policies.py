"""A source's out_of_order and head_failure are judged in the file, each under its own key, so that
a file with both wrong lists both at once instead of one per start."""

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
ordering_key = "/data/order"
out_of_order = "skip"
head_failure = "stop"
"""


def test_both_wrong_policies_are_listed_under_their_keys(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text(SOURCE)
    with pytest.raises(ConfigError) as refused:
        load(path, ENV)
    text = str(refused.value)
    assert "2 problems" in text
    assert "sources.shop.out_of_order: is process or drop" in text
    assert "sources.shop.head_failure: is block or park" in text
