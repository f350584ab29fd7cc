"""``pgonce sweep`` on a node that takes no writes (a standby, default_transaction_read_only):
one error saying so and naming the primary, exit 1, and nothing deleted. Before, every target's
DELETE was refused on its own: a warning per table, then an error naming the first one. --dry-run
only reads, and still counts there."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.test_cli import pgonce
from tests.test_sweeper import add_keys, remaining

EXPIRED = timedelta(days=90)


def _read_only_database(dsn: str) -> str:
    """The test's own database made read-only by its settings, as ALTER DATABASE does it."""
    name = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(
                sql.Identifier(str(name))
            )
        )
    return dsn


def _read_only_options(dsn: str) -> str:
    return make_conninfo(dsn, options="-c default_transaction_read_only=on")


@pytest.mark.parametrize("read_only", [_read_only_database, _read_only_options])
@pytest.mark.parametrize("options", [(), ("--target", "keys", "--target", "inbox"), ("-q",)])
def test_a_read_only_node_is_refused_in_one_line(
    direct_dsn: str, read_only: Callable[[str], str], options: tuple[str, ...]
) -> None:
    add_keys(direct_dsn, 5, age=EXPIRED)
    node = read_only(direct_dsn)
    result = pgonce("sweep", "--dsn", node, *options)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("pgonce: error: sweeping failed: the node is read-only"), line
    assert "point it at the primary" in line
    assert "WARNING" not in result.stderr
    assert remaining(direct_dsn) == 5


def test_a_dry_run_still_counts_on_a_read_only_node(direct_dsn: str) -> None:
    add_keys(direct_dsn, 5, age=EXPIRED)
    result = pgonce("sweep", "--dsn", _read_only_database(direct_dsn), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("dry run: 5 rows would be deleted"), result.stdout


def test_the_same_database_writable_again_is_swept(direct_dsn: str) -> None:
    add_keys(direct_dsn, 5, age=EXPIRED)
    refused = pgonce("sweep", "--dsn", _read_only_options(direct_dsn))
    assert refused.returncode == 1, refused.stdout
    result = pgonce("sweep", "--dsn", direct_dsn, "--target", "keys")
    assert result.returncode == 0, result.stderr
    assert remaining(direct_dsn) == 0
