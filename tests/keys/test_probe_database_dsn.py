"""A connection string with a byte that is not UTF-8 (a Latin-1 password in ``PGONCE_DSN``).

Python hands such a byte of the environment over as a lone surrogate, which libpq cannot be given:
every command that opened the database ended with "internal error: UnicodeEncodeError". It is a
:class:`~pgonce.errors.ConfigError` that says what to do and does not show the string.
"""

from __future__ import annotations

import os

import pytest

from pgonce.config import Settings
from pgonce.database import check_reachable, open_database
from pgonce.errors import ConfigError
from pgonce.store.errors import describe_dsn

PASSWORD = os.fsdecode(b"s\xe9cret")  # what os.environ holds for that byte
DSN = f"postgresql://app:{PASSWORD}@127.0.0.1:5432/app"


def test_a_byte_that_is_not_utf8_is_a_config_error_that_hides_the_string() -> None:
    settings = Settings(dsn=DSN)
    with pytest.raises(ConfigError, match="not UTF-8") as refused, open_database(settings):
        pass
    assert PASSWORD not in str(refused.value)
    assert "percent-encode" in str(refused.value)
    with pytest.raises(ConfigError, match="a byte that is not UTF-8"):
        check_reachable(DSN)


def test_its_description_is_an_unparsable_string() -> None:
    assert describe_dsn(f"host=127.0.0.1 password={PASSWORD}") == "an unparsable connection string"
