"""The pure retention decisions: durations, the horizon guard, batch endings, health judgments."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pgonce.core.retention import (
    DEFAULT_RETENTION,
    DEFAULT_RETRY_HORIZON,
    DEFAULT_SLACK,
    TARGETS,
    GroupFacts,
    Retention,
    RetentionPolicy,
    StuckFacts,
    SweepLimits,
    SweepResult,
    TargetSweep,
    after_batch,
    assess,
    format_duration,
    parse_duration,
    policies_for,
    policy_from_text,
)
from pgonce.errors import ConfigError

DAY = timedelta(days=1)
HOUR = timedelta(hours=1)
T0 = datetime(2026, 6, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30d", 30 * DAY),
        ("72h", 72 * HOUR),
        ("1d12h", 36 * HOUR),
        ("15m", timedelta(minutes=15)),
        ("90s", timedelta(seconds=90)),
        ("250ms", timedelta(milliseconds=250)),
        ("2w", 14 * DAY),
        (" 1.5h ", 90 * timedelta(minutes=1)),
    ],
)
def test_durations_parse(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "30", "d", "30 days", "-1h", "1h-", "9999999999999d"])
def test_bad_durations_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_duration(text)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (72 * HOUR, "3d"),
        (36 * HOUR, "1d12h"),
        (timedelta(minutes=15), "15m"),
        (timedelta(milliseconds=10), "10ms"),
        (timedelta(seconds=2.5), "2.5s"),
        (-DAY, "-1d"),
        (30 * DAY - timedelta(seconds=1), "29d23h"),
    ],
)
def test_durations_format_for_people(value: timedelta, text: str) -> None:
    assert format_duration(value) == text


def test_the_defaults_pass_their_own_guard() -> None:
    # 30 days against 72 hours: the documented defaults must never trip the guard.
    assert DEFAULT_RETENTION >= 10 * DEFAULT_RETRY_HORIZON
    policy = RetentionPolicy()
    assert policy.default == Retention(DEFAULT_RETENTION, DEFAULT_RETRY_HORIZON)


def test_guard_refuses_a_retention_shorter_than_the_retry_horizon() -> None:
    with pytest.raises(ConfigError) as caught:
        RetentionPolicy(default=Retention(keep=DAY, retry_horizon=72 * HOUR))
    message = str(caught.value)
    assert "keys" in message
    assert "every scope" in message
    assert "1d" in message
    assert "3d" in message


def test_guard_names_the_scope_and_both_numbers() -> None:
    with pytest.raises(ConfigError) as caught:
        RetentionPolicy(scopes={"stripe": Retention(keep=2 * DAY, retry_horizon=3 * DAY)})
    message = str(caught.value)
    assert "scope 'stripe'" in message
    assert "2d" in message
    assert "3d" in message


def test_a_retention_equal_to_the_horizon_is_allowed() -> None:
    RetentionPolicy(default=Retention(keep=3 * DAY, retry_horizon=3 * DAY))


@pytest.mark.parametrize(
    "retention",
    [Retention(keep=timedelta(0), retry_horizon=timedelta(0)), Retention(3 * DAY, -HOUR)],
)
def test_guard_refuses_nonsense(retention: Retention) -> None:
    with pytest.raises(ConfigError):
        RetentionPolicy(default=retention)


def test_unknown_target_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no sweep target 'nope'"):
        RetentionPolicy("nope")


def test_policy_from_text_inherits_the_horizon_and_guards_overrides() -> None:
    policy = policy_from_text("keys", overrides=["api=7d", "stripe=60d/5d"])
    assert policy.for_scope("api") == Retention(7 * DAY, DEFAULT_RETRY_HORIZON)
    assert policy.for_scope("stripe") == Retention(60 * DAY, 5 * DAY)
    assert policy.for_scope("other") == policy.default
    assert policy.groups() == ["api", "stripe", None]
    with pytest.raises(ConfigError, match="scope 'slow'"):
        policy_from_text("keys", overrides=["slow=1d"])
    with pytest.raises(ConfigError, match="SCOPE=RETENTION"):
        policy_from_text("keys", overrides=["no-equals-sign"])


def test_params_bound_the_age_by_the_shortest_retention() -> None:
    policy = policy_from_text("keys", keep=30 * DAY, overrides=["api=7d", "audit=90d"])
    params = policy.params(T0)
    assert params["now"] == T0
    assert params["scopes"] == ["api", "audit"]
    assert params["keeps"] == [7 * DAY, 90 * DAY]
    assert params["min_keep"] == 7 * DAY
    assert params["default_keep"] == 30 * DAY


LIMITS = SweepLimits(batch_size=10, max_batches=3)


@pytest.mark.parametrize(
    ("deleted", "batches", "ending"),
    [
        (10, 1, None),
        (10, 2, None),
        (10, 3, "capped"),
        (9, 1, "drained"),
        (0, 1, "drained"),
        # A short batch at the cap means nothing more was due: drained, not capped.
        (4, 3, "drained"),
    ],
)
def test_after_batch(deleted: int, batches: int, ending: str | None) -> None:
    assert after_batch(deleted, batches, LIMITS) == ending


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"max_batches": 0},
        {"pause": timedelta(seconds=-1)},
        {"statement_timeout": timedelta(0)},
    ],
)
def test_limits_refuse_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SweepLimits(**kwargs)  # type: ignore[arg-type]


def test_timeout_is_whole_milliseconds_as_text() -> None:
    assert SweepLimits(statement_timeout=timedelta(seconds=1.5)).timeout_ms == "1500"


def test_summary_says_when_the_cap_ended_a_run() -> None:
    result = SweepResult((TargetSweep("keys", 20, 2, "capped"),), 0.5)
    assert result.capped
    assert result.deleted == 20
    assert "swept 20 rows (keys 20) in 2 batches" in result.summary()
    assert "batch cap reached for keys" in result.summary()
    drained = SweepResult((TargetSweep("keys", 5, 1, "drained"),), 0.1)
    assert not drained.capped
    assert "cap" not in drained.summary()


def group(oldest: timedelta | None, overdue: int = 0) -> GroupFacts:
    return GroupFacts("keys", None, Retention(), oldest, overdue)


def stuck(count: int) -> StuckFacts:
    return StuckFacts("keys", timedelta(minutes=15), count, HOUR if count else None)


def test_a_table_between_both_ends_is_healthy() -> None:
    report = assess(T0, [group(10 * DAY)], [stuck(0)])
    assert report.status == "ok"
    assert report.ok
    assert [f.status for f in report.findings] == ["ok", "ok", "ok", "ok", "ok"]


def test_retired_two_phase_requests_warn_while_recent_and_stay_counted() -> None:
    window = timedelta(days=1)
    recent = replace(stuck(0), retired=(("charge", 2), ("", 1)), retired_age=HOUR)
    report = assess(T0, [group(10 * DAY)], [recent], retired_window=window)
    (finding,) = [f for f in report.findings if f.check == "retired requests"]
    assert finding.status == "warn"
    assert report.status == "warn"
    assert report.ok  # a warning: the answers are stored, nothing is stuck
    assert finding.value == "3 (newest 1h ago); stopped at: charge 2, claimed 1"
    old = replace(recent, retired_age=2 * DAY)
    (finding,) = [
        f
        for f in assess(T0, [group(10 * DAY)], [old], retired_window=window).findings
        if f.check == "retired requests"
    ]
    assert finding.status == "ok"
    assert finding.value.startswith("3 (newest 2d")


def test_an_empty_table_is_healthy() -> None:
    assert assess(T0, [group(None)], [stuck(0)]).status == "ok"


def test_a_young_table_is_healthy() -> None:
    report = assess(T0, [group(HOUR)], [stuck(0)])
    assert report.status == "ok"
    (young,) = [f for f in report.findings if f.check == "oldest row vs retry horizon"]
    assert "young table" in young.detail


def test_a_row_deleted_within_the_retry_horizon_fails() -> None:
    early = replace(group(HOUR), deleted_age=DEFAULT_RETRY_HORIZON - timedelta(seconds=1))
    report = assess(T0, [early], [stuck(0)])
    assert not report.ok
    (finding,) = [f for f in report.findings if f.status == "fail"]
    assert finding.check == "oldest row vs retry horizon"
    assert "a retry of it would run again" in finding.detail
    on_time = replace(early, deleted_age=DEFAULT_RETRY_HORIZON)
    assert assess(T0, [on_time], [stuck(0)]).status == "ok"


def test_rows_past_retention_plus_slack_mean_a_stalled_sweeper() -> None:
    edge = DEFAULT_RETENTION + DEFAULT_SLACK
    assert assess(T0, [group(edge)], []).status == "ok"
    report = assess(T0, [group(edge + timedelta(seconds=1), overdue=3)], [])
    assert not report.ok
    (stalled,) = [f for f in report.findings if f.status == "fail"]
    assert stalled.check == "oldest row vs retention"
    assert "sweeper" in stalled.detail


def test_stuck_claims_fail() -> None:
    report = assess(T0, [group(10 * DAY)], [stuck(2)])
    assert not report.ok
    (finding,) = [f for f in report.findings if f.check == "stuck claims"]
    assert finding.status == "fail"
    assert finding.value == "2 (oldest 1h)"


def test_every_target_gets_a_policy_the_given_one_or_the_defaults() -> None:
    custom = RetentionPolicy(default=Retention(keep=60 * DAY))
    assert policies_for([]) == [RetentionPolicy(name) for name in TARGETS]
    assert policies_for([custom])[0] is custom
    assert policies_for([custom], targets=["keys"]) == [custom]
    with pytest.raises(ConfigError, match="no sweep target 'nope'"):
        policies_for([], targets=["nope"])


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        ({"batch_size": 2.5}, "batch_size must be an int"),
        ({"batch_size": True}, "batch_size must be an int"),
        ({"batch_size": "5"}, "batch_size must be an int"),
        ({"batch_size": 2**63}, "from 1 to"),
        ({"batch_size": 0}, "from 1 to"),
        ({"max_batches": 2.5}, "max_batches must be an int"),
        ({"pause": 1}, "pause must be a datetime.timedelta"),
        ({"statement_timeout": 5000}, "statement_timeout must be a datetime.timedelta"),
        ({"statement_timeout": timedelta(days=25)}, "at most 24 days"),
    ],
)
def test_sweep_limits_the_server_would_refuse_are_refused_when_made(
    limits: dict[str, Any], match: str
) -> None:
    # Each of these used to pass here and fail at the first batch (LIMIT true, an out-of-range
    # statement_timeout), or raise a bare TypeError, or sweep LIMIT 2.5.
    with pytest.raises(ConfigError, match=match):
        SweepLimits(**limits)
    assert SweepLimits(statement_timeout=timedelta(days=24)).timeout_ms == "2073600000"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RetentionPolicy(default=Retention(keep=5)), "keep .*timedelta"),  # type: ignore[arg-type]
        (lambda: RetentionPolicy(default=Retention(retry_horizon=5)), "retry_horizon"),  # type: ignore[arg-type]
        (lambda: RetentionPolicy(scopes={"api": 5}), "must be a Retention"),  # type: ignore[dict-item]
        (lambda: RetentionPolicy(scopes=[("api", Retention())]), "mapping"),  # type: ignore[arg-type]
        (lambda: policies_for(RetentionPolicy()), r"\[policy\]"),  # type: ignore[arg-type]
        (lambda: policies_for([5]), "must be a RetentionPolicy"),  # type: ignore[list-item]
        (lambda: policies_for([], "keys"), r"\['keys'\]"),
    ],
    ids=["keep", "horizon", "scope-value", "scopes", "lone-policy", "not-a-policy", "lone-target"],
)
def test_policies_of_the_wrong_shape_are_config_errors(make: Any, match: str) -> None:
    # Each raised a bare TypeError or AttributeError, or ("keys") swept the targets k, e, y, s.
    with pytest.raises(ConfigError, match=match):
        make()
