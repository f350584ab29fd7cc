"""``pgonce replay`` with an empty source, event id or aggregate type (a shell variable that came
out empty): a usage error, exit 2, before anything connects. Before, the command connected and
then failed with exit 1, as if the database had."""

from __future__ import annotations

import pytest

from tests.test_cli import pgonce

#: A port nothing listens on: the usage error must come before any connection.
NOWHERE = "postgresql://postgres@127.0.0.1:1/test"


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--source", ""), "--source"),
        (("--source", "shop", "--event-id", ""), "--event-id"),
        (("--outbox", "--aggregatetype", ""), "--aggregatetype"),
    ],
    ids=["source", "event-id", "aggregatetype"],
)
def test_an_empty_name_is_a_usage_error(args: tuple[str, ...], option: str) -> None:
    result = pgonce("replay", "--dsn", NOWHERE, *args)
    assert result.returncode == 2, result.stderr
    assert f"argument {option}: must not be empty" in result.stderr
    assert "cannot connect" not in result.stderr
    assert "Traceback" not in result.stderr
