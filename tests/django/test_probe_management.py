"""``manage.py pgonce_migrate`` refuses what is wrong with a message (Django's CommandError: one
line, exit status 1), never a traceback."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

pytestmark = pytest.mark.django_db(transaction=True)


def migrate(*args: str) -> str:
    out = io.StringIO()
    call_command("pgonce_migrate", *args, stdout=out)
    return out.getvalue()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--database", "nope"], "invalid choice: 'nope'"),
        (["--database", "sqlite"], "pgonce needs PostgreSQL"),
        (["--schema", "bad;name"], "schema name 'bad;name' is not allowed"),
    ],
    ids=["unknown-alias", "not-postgresql", "bad-schema-name"],
)
def test_a_wrong_option_is_a_command_error(args: list[str], said: str) -> None:
    with pytest.raises(CommandError, match=said):
        migrate(*args)


def test_a_database_that_cannot_be_reached_is_a_command_error() -> None:
    name = connection.settings_dict["NAME"]
    connection.settings_dict["NAME"] = "pgonce_no_such_database"
    try:
        with pytest.raises(CommandError, match=r"pgonce_migrate: .*pgonce_no_such_database"):
            migrate()
    finally:
        connection.settings_dict["NAME"] = name


def test_the_default_alias_is_migrated_and_found_current() -> None:
    assert "up to date" in migrate()
    assert "up to date" in migrate("--database", "default")
