"""Counts given on the command line (orders, copies, connections) are refused at the call when they
cannot mean anything, as usage errors (exit 2), before anything is run or fired."""

from __future__ import annotations

import pytest

from tests.test_cli import pgonce


def usage_error(*args: str) -> str:
    result = pgonce(
        *args, env={"PGONCE_DSN": "postgresql://u:hunter2@127.0.0.1:1/x"}, own_settings=True
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert "hunter2" not in result.stderr
    assert result.stderr.startswith("usage: pgonce"), result.stderr
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("option", ["--orders", "--copies", "--connections"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_demo_counts_must_be_positive(option: str, value: str) -> None:
    line = usage_error("demo", option, value)
    assert f"argument {option}: {value} is not a whole number of at least 1" in line


@pytest.mark.parametrize("option", ["--demo-orders", "--demo-copies"])
@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_serve_demo_counts_must_be_positive(option: str, value: str) -> None:
    # Before this was refused, --demo-copies -1 fired a storm of nothing and printed
    # "exactly once: NO" after a minute; --demo-orders 0 proved "yes" on no event at all.
    line = usage_error("serve", "--config", "/nonexistent/pgonce.toml", "--demo", option, value)
    assert f"argument {option}: " in line


@pytest.mark.parametrize("value", ["0", "-5", "1001"])
def test_send_copies_is_refused_out_of_range(value: str) -> None:
    line = usage_error("send", "--source", "shop", "--copies", value)
    assert "argument --copies: " in line


@pytest.mark.parametrize("kind", ["http", "webhooks"])
def test_verbose_is_taken_after_a_conformance_kind_too(kind: str) -> None:
    # -v is taken before and after every command; after `conformance http URL` it was refused.
    result = pgonce("conformance", kind, "http://127.0.0.1:1/", "-v", own_settings=True)
    assert "unrecognized arguments" not in result.stderr, result.stderr
    assert result.returncode in (1, 2), result.stderr


@pytest.mark.parametrize("value", ["1", "-0.1", "nan", "often"])
def test_demo_crash_rate_is_a_usage_error_out_of_range(value: str) -> None:
    line = usage_error("demo", "--crash-rate", value)
    assert "argument --crash-rate: " in line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("replay", "--source", "shop", "--id", "5"), "--id and --aggregatetype go with --outbox"),
        (("replay", "--outbox", "--event-id", "x"), "--event-id goes with --source"),
        (("events", "--show", "--id", "x"), "--show needs --source and --id"),
    ],
)
def test_options_that_do_not_go_together_are_usage_errors(args: tuple[str, ...], said: str) -> None:
    line = usage_error(*args)
    assert line.startswith(f"pgonce {args[0]}: error: "), line
    assert said in line
