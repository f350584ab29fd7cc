"""``pgonce events --limit`` above the most rows a listing shows: a usage error naming the bound.
Before, it was cut to that bound without a word, and a listing of 1000 rows read as all there
were."""

from __future__ import annotations

from pgonce.store._sync.inspect import MAX_LIST
from tests.test_cli import pgonce


def test_a_limit_above_the_listing_bound_is_a_usage_error() -> None:
    result = pgonce("events", "--dsn", "postgresql://postgres@127.0.0.1:1/test", "--limit", "5000")
    assert result.returncode == 2, result.stderr
    assert f"'5000' is more than {MAX_LIST}" in result.stderr
    assert "cannot connect" not in result.stderr


def test_the_bound_itself_is_taken(direct_dsn: str) -> None:
    result = pgonce("events", "--dsn", direct_dsn, "--limit", str(MAX_LIST))
    assert result.returncode == 0, result.stderr
    assert "no events match" in result.stdout
