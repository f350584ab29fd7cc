"""``pgonce doctor --timeout`` beyond PostgreSQL's longest statement timeout (24 days): a usage
error naming the option, before anything connects. Before, the check refused it after
connecting, with exit 1, as "the sweep statement timeout"."""

from __future__ import annotations

from tests.test_cli import pgonce


def test_a_timeout_beyond_postgresql_s_bound_is_a_usage_error() -> None:
    result = pgonce("doctor", "--dsn", "postgresql://postgres@127.0.0.1:1/test", "--timeout", "25d")
    assert result.returncode == 2, result.stderr
    assert "argument --timeout: '25d' is longer than PostgreSQL's longest statement timeout" in (
        result.stderr
    )
    assert "sweep" not in result.stderr.splitlines()[-1]
    assert "cannot connect" not in result.stderr


def test_the_bound_itself_is_taken(direct_dsn: str) -> None:
    result = pgonce("doctor", "--dsn", direct_dsn, "--timeout", "24d")
    assert result.returncode == 0, result.stderr
    assert "checked at" in result.stdout
