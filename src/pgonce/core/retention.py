"""Retention: how long pgonce's rows live, what the sweeper may delete, and what health means.

Pure decisions, no I/O. The store's sweeper and health check run the SQL; everything they decide
with the results is here, so it is tested without a database.

Guarantees a reader must not break:

- **The horizon guard.** A retention shorter than the retry horizon it must cover is refused with
  :class:`~pgonce.errors.ConfigError` naming the target, the scope (or source) and both durations,
  when the policy is built: before a sweeper, a health check or a command can start. A key deleted
  while its provider still retries would let the retry run the work a second time.
- **Bounded runs.** A sweep deletes in batches of ``batch_size``, stops a target at its first short
  batch, and never runs more than ``max_batches`` batches of one target in one run.
- **Sweep targets.** Every table the sweeper serves is a :class:`SweepTarget` in :data:`TARGETS`,
  with one ``delete_<name>`` statement in ``sql/queries/sweep.sql`` and one ``horizon_<name>`` in
  ``sql/queries/health.sql``. Those statements alone say which rows are deletable (for the key
  store: completed keys only, never a claim in flight).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from pgonce.core.frozen import refuse_changes
from pgonce.errors import ConfigError

#: How long a completed key (or a processed delivery) is kept. Thirty days is ten times the
#: longest common provider retry horizon (Stripe retries for 3 days, GitHub and Shopify for less),
#: leaves room for a client that replays a day-old request after an outage, and still lets support
#: answer "what did we reply?" for a month. Storage is the price: about 1 KB per key.
DEFAULT_RETENTION = timedelta(days=30)

#: How long a caller or provider may retry the same key when it declares nothing else. 72 hours is
#: Stripe's documented retry horizon (up to 3 days with exponential backoff), the longest of the
#: common webhook providers; API clients retry for minutes.
DEFAULT_RETRY_HORIZON = timedelta(hours=72)

#: Rows per batch. A batch of 1,000 short rows deletes in a few milliseconds, locks only those rows
#: and writes a small WAL record per commit, so claims running beside it hardly notice.
DEFAULT_BATCH_SIZE = 1000

#: Batches of one target per run: a run ends in bounded time (up to 1,000,000 rows at the default
#: batch size) and the next run continues where it stopped.
DEFAULT_MAX_BATCHES = 1000

#: Pause between batches. A batch of 1,000 rows deletes in a millisecond or two, so CPU is not what
#: a sweeper costs the claims beside it; what grows with its rate is WAL: each batch dirties some
#: thirty pages, written whole on their first change after a checkpoint, and the claims' commits
#: wait for that WAL to be flushed. Measured (`make bench`, sweep; 2 shared cores): claim p99 while
#: sweeping at 131-161 % of alone with a 50 ms pause (17,900 rows/s), 125 % at 150 ms (6,800
#: rows/s), 110-122 % at 250 ms (4,400 rows/s), 107-118 % at 300 ms (3,700 rows/s; three runs each
#: at 250 and 300 ms). 300 ms stays within a 20 % budget in every run and still removes some 320
#: million keys a day, 3.7 times what 1,000 claims/s around the clock (86 million a day) leave
#: behind. Lower it to catch up on a backlog off-peak.
DEFAULT_PAUSE = timedelta(milliseconds=300)

#: Statement timeout of one batch (SET LOCAL). A batch takes milliseconds; one that runs for seconds
#: is fighting something, and giving up is better than holding locks (the next run retries).
DEFAULT_STATEMENT_TIMEOUT = timedelta(seconds=5)

#: How often the in-process sweeper runs. Five minutes keeps overdue rows to five minutes' worth of
#: traffic, and costs one cheap statement per target when nothing is due.
DEFAULT_SWEEP_EVERY = timedelta(minutes=5)

#: A claim in flight for longer than this is stuck. With ``once()`` a claim commits together with
#: its response, so a committed claim without one means the caller committed between claim and
#: completion; fifteen minutes is longer than any request or webhook handler should run (gateways
#: cut requests after a minute, providers after 10 to 30 seconds). Every retry of a stuck key is
#: answered "in flight" until someone looks, so health reports it as a failure.
DEFAULT_STUCK_AFTER = timedelta(minutes=15)

#: How long a two-phase request the completer retired keeps health at "warn". A retirement means a
#: request that failed every time (a payment that may be charged at the provider, answered 500
#: for good): someone should look. A day is long enough that a daily look at ``pgonce doctor``
#: sees it; after that the count stays visible (and in the metrics) until the sweeper deletes the
#: key, without keeping health yellow for the whole retention.
DEFAULT_RETIRED_WINDOW = timedelta(days=1)

#: How far the oldest key may outlive its retention before health says the sweeper stalled: a day
#: covers a nightly cron job that missed one night, or a run that hit its batch cap.
DEFAULT_SLACK = timedelta(days=1)

#: Statement timeout of the health queries. They read whole tables (no index answers "oldest
#: completed key"); 30 seconds bounds a scrape of a very large table.
DEFAULT_HEALTH_TIMEOUT = timedelta(seconds=30)


@refuse_changes
@dataclass(frozen=True, slots=True)
class SweepTarget:
    """A pgonce table the sweeper keeps short.

    Registering one takes three lines: a ``SweepTarget`` added to :data:`TARGETS`, a
    ``delete_<name>`` statement in ``queries/sweep.sql`` and a ``horizon_<name>`` statement in
    ``queries/health.sql`` (both files describe the parameters their statements receive).
    """

    #: The table's name, and the suffix of its statements.
    name: str
    #: What retention is set per, in this table's words ("scope" for keys, "source" for the inbox).
    scope_word: str
    #: The timestamp that ages a row.
    age_column: str
    #: Which rows may be deleted once old, in words (the statement is the truth).
    deletable: str
    #: Whether ``stuck_<name>`` exists in health.sql (rows that should have finished and did not).
    has_stuck: bool = False
    #: Whether ``delete_<name>_by_ctid`` exists in sweep.sql (the faster path on plain PostgreSQL).
    has_ctid_twin: bool = False


KEYS = SweepTarget(
    name="keys",
    scope_word="scope",
    age_column="completed_at",
    deletable="completed keys (completed_at IS NOT NULL); never a claim in flight",
    has_stuck=True,
    has_ctid_twin=True,
)

INBOX = SweepTarget(
    name="inbox",
    scope_word="source",
    age_column="received_at",
    deletable="handled deliveries (done, skipped); never a pending event or a dead letter",
)

OUTBOX = SweepTarget(
    name="outbox",
    scope_word="outbox",  # the outbox has no scope: one retention for every row
    age_column="published_at",
    deletable="published rows; never a row waiting for the broker, nor a parked one",
)

OUTBOX_AGGREGATES = SweepTarget(
    name="outbox_aggregates",
    scope_word="outbox",
    age_column="last_enqueued_at",
    deletable="lock rows of aggregates idle for the retention, with nothing left to publish",
)

#: Every table the sweeper serves, in sweep order.
TARGETS: dict[str, SweepTarget] = {
    target.name: target for target in (KEYS, INBOX, OUTBOX, OUTBOX_AGGREGATES)
}


def target(name: str) -> SweepTarget:
    try:
        return TARGETS[name]
    except KeyError:
        known = ", ".join(TARGETS)
        raise ConfigError(f"no sweep target {name!r}; the targets are: {known}") from None


# --------------------------------------------------------------------------------------------
# Durations, as people write them in flags and read them in messages.

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|w|d|h|m|s)")
_UNITS = {
    "w": timedelta(weeks=1),
    "d": timedelta(days=1),
    "h": timedelta(hours=1),
    "m": timedelta(minutes=1),
    "s": timedelta(seconds=1),
    "ms": timedelta(milliseconds=1),
}


def parse_duration(text: str) -> timedelta:
    """``"30d"``, ``"72h"``, ``"1d12h"``, ``"15m"``, ``"90s"``, ``"250ms"`` as a timedelta."""
    compact = text.strip().lower().replace(" ", "")
    pos, total = 0, timedelta(0)
    while pos < len(compact):
        match = _DURATION.match(compact, pos)
        if not match:
            raise ConfigError(
                f"{text!r} is not a duration: write a number and a unit (w, d, h, m, s, ms), "
                "e.g. 30d, 72h, 1d12h, 15m, 500ms"
            )
        try:
            total += float(match[1]) * _UNITS[match[2]]
        except OverflowError:  # past timedelta's ~2.7 million years
            raise ConfigError(f"{text!r} is too long a duration") from None
        pos = match.end()
    if pos == 0:
        raise ConfigError(f"{text!r} is not a duration (e.g. 30d, 72h, 15m)")
    return total


def format_duration(value: timedelta) -> str:
    """A short human form: ``3d``, ``1d12h``, ``15m``, ``2.5s``; negative values get a sign."""
    if value < timedelta(0):
        return "-" + format_duration(-value)
    if value < timedelta(seconds=1):
        return f"{value / timedelta(milliseconds=1):.0f}ms"
    if value < timedelta(minutes=1):
        return f"{value.total_seconds():.3g}s"
    rest = int(value.total_seconds())
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        amount, rest = divmod(rest, size)
        if amount:
            parts.append(f"{amount}{unit}")
    # Two units are enough to read; "29d23h" says what "29d23h59m58s" says.
    return "".join(parts[:2])


# --------------------------------------------------------------------------------------------
# Retention policies and the horizon guard.


@refuse_changes
@dataclass(frozen=True, slots=True)
class Retention:
    """How long rows are kept, and how long the other side keeps retrying them."""

    #: How long a row is kept, from its target's age column (a key: from its completion).
    keep: timedelta = DEFAULT_RETENTION
    #: How long senders keep retrying; ``keep`` must cover it.
    retry_horizon: timedelta = DEFAULT_RETRY_HORIZON


@refuse_changes
@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """The retention of one sweep target: a default, and overrides per scope (or source).

    Building one runs the horizon guard: every retention must cover its retry horizon.
    """

    target: str = KEYS.name
    default: Retention = field(default_factory=Retention)
    scopes: Mapping[str, Retention] = field(default_factory=dict)

    def __post_init__(self) -> None:
        found = target(self.target)
        _guard(found, None, self.default)
        if not isinstance(self.scopes, Mapping):
            raise ConfigError(
                f"the scopes of {found.name} are a mapping of {found.scope_word} to Retention, "
                f"not {type(self.scopes).__name__}"
            )
        for scope, retention in self.scopes.items():
            if not isinstance(scope, str) or not scope:
                raise ConfigError(f"a {found.scope_word} of {found.name} must be a non-empty text")
            _guard(found, scope, retention)

    def for_scope(self, scope: str | None) -> Retention:
        """The retention of ``scope``; ``None`` means every scope without its own."""
        if scope is None:
            return self.default
        return self.scopes.get(scope, self.default)

    def groups(self) -> list[str | None]:
        """The scopes with their own retention, then ``None`` for all the others."""
        return [*sorted(self.scopes), None]

    def params(self, now: datetime | None) -> dict[str, Any]:
        """The parameters every ``delete_<target>`` and ``horizon_<target>`` statement takes."""
        names = sorted(self.scopes)
        keeps = [self.scopes[name].keep for name in names]
        return {
            "now": now,
            "default_keep": self.default.keep,
            "scopes": names,
            "keeps": keeps,
            "min_keep": min([self.default.keep, *keeps]),
        }


def policies_for(
    policies: Iterable[RetentionPolicy], targets: Iterable[str] | None = None
) -> list[RetentionPolicy]:
    """One policy per target, in sweep order; a target without one gets the defaults.

    ``targets`` restricts the list to those names (default: every registered target); policies of
    other targets are left out.
    """
    if isinstance(policies, RetentionPolicy):
        raise ConfigError("policies are a list of RetentionPolicy: give [policy], not policy")
    given = {}
    for policy in policies:
        if not isinstance(policy, RetentionPolicy):
            raise ConfigError(f"a policy must be a RetentionPolicy, not {type(policy).__name__}")
        given[policy.target] = policy
    if isinstance(targets, str):
        # Iterated, "keys" was the targets k, e, y and s.
        raise ConfigError(f"targets are a list of names: give [{targets!r}], not {targets!r}")
    names = list(TARGETS) if targets is None else [target(name).name for name in targets]
    return [given.get(name) or RetentionPolicy(name) for name in names]


def _guard(found: SweepTarget, scope: str | None, retention: Retention) -> None:
    where = f"{found.scope_word} {scope!r}" if scope else f"every {found.scope_word}"
    what = f"the retention of {found.name} for {where}"
    # Types first: a number compared with a timedelta raised a bare TypeError here, and one that
    # got past it would have reached the sweeper's SQL.
    if not isinstance(retention, Retention):
        raise ConfigError(f"{what} must be a Retention, not {type(retention).__name__}")
    for name in ("keep", "retry_horizon"):
        value = getattr(retention, name)
        if not isinstance(value, timedelta):
            raise ConfigError(
                f"{name} of {found.name} for {where} must be a datetime.timedelta, "
                f"not {type(value).__name__}"
            )
    if retention.keep <= timedelta(0):
        raise ConfigError(f"{what} must be positive, not {format_duration(retention.keep)}")
    if retention.retry_horizon < timedelta(0):
        raise ConfigError(f"the retry horizon of {found.name} for {where} must not be negative")
    if retention.keep < retention.retry_horizon:
        raise ConfigError(
            f"{what} is {format_duration(retention.keep)}, shorter than its retry horizon of "
            f"{format_duration(retention.retry_horizon)}: a retry arriving after "
            f"{format_duration(retention.keep)} would find no key and run again. Keep "
            f"{found.name} for at least {format_duration(retention.retry_horizon)}."
        )


def policy_from_text(
    target_name: str,
    *,
    keep: timedelta = DEFAULT_RETENTION,
    retry_horizon: timedelta = DEFAULT_RETRY_HORIZON,
    overrides: Iterable[str] = (),
) -> RetentionPolicy:
    """A policy from command-line words: ``overrides`` are ``SCOPE=KEEP`` or ``SCOPE=KEEP/HORIZON``.

    A scope without its own horizon inherits ``retry_horizon``.
    """
    scopes = dict(scope_retention(item, retry_horizon) for item in overrides)
    return RetentionPolicy(target_name, Retention(keep, retry_horizon), scopes)


def scope_retention(item: str, retry_horizon: timedelta) -> tuple[str, Retention]:
    """One ``SCOPE=KEEP`` or ``SCOPE=KEEP/HORIZON`` word read (the horizon guard is the
    policy's); :class:`ConfigError` for a word that does not read."""
    name, sep, spec = item.partition("=")
    if not sep or not name:
        raise ConfigError(f"{item!r}: write SCOPE=RETENTION or SCOPE=RETENTION/RETRY_HORIZON")
    keep_text, _, horizon_text = spec.partition("/")
    return name, Retention(
        keep=parse_duration(keep_text),
        retry_horizon=parse_duration(horizon_text) if horizon_text else retry_horizon,
    )


# --------------------------------------------------------------------------------------------
# Batch decisions.


#: The largest batch: LIMIT's bigint. A batch is meant to be small (see DEFAULT_BATCH_SIZE); the
#: bound only turns a value the server refuses at the first batch into an error at the start.
_MAX_BATCH_SIZE = 2**63 - 1

#: PostgreSQL's largest statement_timeout (INT_MAX milliseconds, about 24.8 days).
_MAX_STATEMENT_TIMEOUT = timedelta(milliseconds=2**31 - 1)


#: The longest pause between two batches: a pause is a rest for the server (tens of milliseconds
#: by default), not a schedule (that is cron's).
MAX_PAUSE = timedelta(days=1)


@refuse_changes
@dataclass(frozen=True, slots=True)
class SweepLimits:
    """How a sweep run is bounded; see the ``DEFAULT_*`` constants for why each value."""

    batch_size: int = DEFAULT_BATCH_SIZE
    max_batches: int = DEFAULT_MAX_BATCHES
    pause: timedelta = DEFAULT_PAUSE
    statement_timeout: timedelta = DEFAULT_STATEMENT_TIMEOUT

    def __post_init__(self) -> None:
        # Types first: a float, a bool or a str compared fine or not at all, and otherwise
        # reached the server at the first batch (LIMIT 2.5, LIMIT true) or raised TypeError.
        for name in ("batch_size", "max_batches"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ConfigError(f"{name} must be an int, not {type(value).__name__}")
        for name in ("pause", "statement_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta):
                raise ConfigError(
                    f"{name} must be a datetime.timedelta, not {type(value).__name__}"
                )
        if not 1 <= self.batch_size <= _MAX_BATCH_SIZE:
            raise ConfigError(
                f"the sweep batch size must be from 1 to {_MAX_BATCH_SIZE:,}, not {self.batch_size}"
            )
        if self.max_batches < 1:
            raise ConfigError(f"the batch cap must be at least 1, not {self.max_batches}")
        if self.pause < timedelta(0):
            raise ConfigError("the pause between sweep batches must not be negative")
        if self.pause > MAX_PAUSE:
            # Beyond what the platform can sleep, a run ended in an OverflowError after its
            # first batch had deleted rows.
            raise ConfigError(
                f"the pause between sweep batches must be at most {MAX_PAUSE.days} day, not "
                f"{self.pause}: it is a rest between two batches of one run; schedule runs with "
                "cron"
            )
        if self.statement_timeout < timedelta(milliseconds=1):
            raise ConfigError("the sweep statement timeout must be at least 1ms")
        if self.statement_timeout > _MAX_STATEMENT_TIMEOUT:
            # PostgreSQL's own bound (an int of milliseconds): above it every batch would fail.
            raise ConfigError(
                "the sweep statement timeout must be at most "
                f"{_MAX_STATEMENT_TIMEOUT.days} days, not {self.statement_timeout}"
            )

    @property
    def timeout_ms(self) -> str:
        """``statement_timeout`` as PostgreSQL's setting wants it (whole milliseconds, as text)."""
        return str(max(1, round(self.statement_timeout / timedelta(milliseconds=1))))


#: Why a target's run ended: a short batch (nothing more is due), the batch cap, or a stop request.
Ending = Literal["drained", "capped", "stopped"]


def after_batch(deleted: int, batches: int, limits: SweepLimits) -> Ending | None:
    """What follows a batch that deleted ``deleted`` rows as the ``batches``-th of its run.

    ``None``: sweep the next batch. A short batch ends the target's run even when the cap is
    reached at the same time: nothing more is due, so the run was not cut short.
    """
    if deleted < limits.batch_size:
        return "drained"
    if batches >= limits.max_batches:
        return "capped"
    return None


@refuse_changes
@dataclass(frozen=True, slots=True)
class TargetSweep:
    """What one run did to one target, and whether its batches joined on ctid."""

    target: str
    deleted: int
    batches: int
    ending: Ending
    by_ctid: bool = False


@refuse_changes
@dataclass(frozen=True, slots=True)
class SweepResult:
    """What one run did, per target."""

    targets: tuple[TargetSweep, ...]
    seconds: float

    @property
    def deleted(self) -> int:
        return sum(t.deleted for t in self.targets)

    @property
    def batches(self) -> int:
        return sum(t.batches for t in self.targets)

    @property
    def capped(self) -> bool:
        """True when a target still had rows due when its batch cap ended the run."""
        return any(t.ending == "capped" for t in self.targets)

    def summary(self) -> str:
        """One line for people and for cron mail."""
        per_target = ", ".join(f"{t.target} {t.deleted:,}" for t in self.targets)
        batches = f"{self.batches:,} batch" + ("" if self.batches == 1 else "es")
        line = f"swept {self.deleted:,} rows ({per_target}) in {batches}, {self.seconds:.2f}s"
        capped = [t.target for t in self.targets if t.ending == "capped"]
        if capped:
            line += f"; batch cap reached for {', '.join(capped)}: more is due next run"
        if any(t.ending == "stopped" for t in self.targets):
            line += "; stopped on request"
        return line


# --------------------------------------------------------------------------------------------
# Health: the two assertions of the design, as decisions on facts the store reads.

Status = Literal["ok", "warn", "fail"]
_RANK: dict[Status, int] = {"ok": 0, "warn": 1, "fail": 2}


@refuse_changes
@dataclass(frozen=True, slots=True)
class GroupFacts:
    """The retained rows of one scope group of a target: a scope with its own retention, or
    ``scope=None`` for every scope without one."""

    target: str
    scope: str | None
    retention: Retention
    #: Age of the oldest row that is deletable once old (for keys: the oldest completed key) at
    #: ``checked_at``; ``None`` when there is none.
    oldest_age: timedelta | None
    #: Rows past their retention that are still there (the sweeper's backlog).
    overdue: int
    #: Age at ``checked_at`` of the newest row the sweeper deleted (``sweep_marks``); ``None`` when
    #: it deleted none. Younger than the retry horizon: a row went while its sender may retry it.
    deleted_age: timedelta | None = None


@refuse_changes
@dataclass(frozen=True, slots=True)
class StuckFacts:
    """Rows of a target that should have finished and did not (claims in flight, for keys)."""

    target: str
    threshold: timedelta
    count: int
    oldest_age: timedelta | None
    #: Two-phase requests (keys) whose lease expired longer than ``threshold`` ago, by the
    #: recovery point they stopped at ("" before the first phase): (point, count).
    phases: tuple[tuple[str, int], ...] = ()
    #: Two-phase requests (keys) the completer retired whose key is still kept, by the recovery
    #: point they stopped at: (point, count).
    retired: tuple[tuple[str, int], ...] = ()
    #: Age of the newest retirement; ``None`` when there is none.
    retired_age: timedelta | None = None


@refuse_changes
@dataclass(frozen=True, slots=True)
class Finding:
    """One line of the health table."""

    check: str
    target: str
    scope: str | None
    status: Status
    value: str
    limit: str
    detail: str


def judge_stuck(facts: StuckFacts) -> Finding:
    if facts.phases:
        stopped = ", ".join(f"{point or 'claimed'} {count:,}" for point, count in facts.phases)
        return Finding(
            "stuck claims",
            facts.target,
            None,
            "fail",
            f"{facts.count:,}; two-phase stopped at: {stopped}",
            f"none older than {format_duration(facts.threshold)}",
            "two-phase requests whose holder's lease ran out and nobody resumed: a client's "
            "retry resumes one from its recovery point, the completer resumes those of a "
            "registered operation within its max_age (see pgonce.key_leases)",
        )
    if facts.count == 0:
        limit = f"none older than {format_duration(facts.threshold)}"
        return Finding("stuck claims", facts.target, None, "ok", "0", limit, "")
    oldest = format_duration(facts.oldest_age) if facts.oldest_age is not None else "?"
    return Finding(
        "stuck claims",
        facts.target,
        None,
        "fail",
        f"{facts.count:,} (oldest {oldest})",
        f"none older than {format_duration(facts.threshold)}",
        "claims committed without a response: every retry of these keys is answered 'in flight'; "
        "complete or release them (see keys_readable WHERE completed_at IS NULL)",
    )


def judge_retired(facts: StuckFacts, window: timedelta) -> Finding:
    """Two-phase requests the completer retired: "warn" while the newest is younger than
    ``window``, then "ok" with the count still shown until the sweeper deletes the keys."""
    limit = f"none in the last {format_duration(window)}"
    count = sum(n for _, n in facts.retired)
    if not count:
        return Finding("retired requests", facts.target, None, "ok", "0", limit, "")
    stopped = ", ".join(f"{point or 'claimed'} {n:,}" for point, n in facts.retired)
    newest = format_duration(facts.retired_age) if facts.retired_age is not None else "?"
    recent = facts.retired_age is not None and facts.retired_age < window
    return Finding(
        "retired requests",
        facts.target,
        None,
        "warn" if recent else "ok",
        f"{count:,} (newest {newest} ago); stopped at: {stopped}",
        limit,
        "two-phase requests whose holders kept failing: the completer stored a 500 problem "
        "answer, which every retry replays. A phase past a third party's call may have acted "
        "there (a charge): look at each (pgonce.key_leases WHERE locked_until = 'infinity': its "
        "point, attempts and last_error) and settle it with its owner",
    )


def judge_horizon(facts: GroupFacts, slack: timedelta) -> list[Finding]:
    """Both ends of the retention horizon, and the overdue rows, for one scope group.

    - No row may be deleted while its sender may still retry it. The sweeper notes the newest row
      it deleted; if that row is younger than the retry horizon, the retry would run again: a
      failure. A young oldest row alone is a young table (or a quiet spell), never an alarm: every
      new deployment has one for as long as the retry horizon.
    - The oldest key must be younger than retention plus ``slack``, else the sweeper stalled.
    """
    retention = facts.retention
    horizon = format_duration(retention.retry_horizon)
    findings = []
    age = facts.oldest_age
    value = format_duration(age) if age is not None else "no rows"
    deleted = facts.deleted_age
    status: Status = "ok"
    detail = ""
    if deleted is not None and deleted < retention.retry_horizon:
        status = "fail"
        value = f"{value}; one deleted at {format_duration(deleted)}"
        detail = (
            f"the sweeper deleted a row {format_duration(deleted)} old, within the {horizon} its "
            "senders keep retrying: a retry of it would run again. A sweeper runs with a retention "
            "shorter than this check's retry horizon: give every sweeper the same retention"
        )
    elif age is not None and age < retention.retry_horizon:
        detail = (
            f"a young table: nothing the sweeper deleted is younger than {horizon}"
            if deleted is not None
            else "a young table: the sweeper has deleted nothing yet"
        )
    findings.append(
        Finding(
            "oldest row vs retry horizon",
            facts.target,
            facts.scope,
            status,
            value,
            f">= {horizon}",
            detail,
        )
    )
    ceiling = retention.keep + slack
    stalled = age is not None and age > ceiling
    findings.append(
        Finding(
            "oldest row vs retention",
            facts.target,
            facts.scope,
            "fail" if stalled else "ok",
            value,
            f"<= {format_duration(ceiling)}",
            "rows outlive their retention: the sweeper is not running, or cannot keep up"
            if stalled
            else "",
        )
    )
    findings.append(
        Finding(
            "overdue rows",
            facts.target,
            facts.scope,
            "ok",
            f"{facts.overdue:,}",
            f"older than {format_duration(retention.keep)}",
            "",
        )
    )
    return findings


if TYPE_CHECKING:
    from pgonce.core.durability import Durability
    from pgonce.core.mvcc import MvccHorizon


@refuse_changes
@dataclass(frozen=True, slots=True)
class HealthReport:
    """The health figures (for metrics) and the findings on them (for ``pgonce doctor``)."""

    checked_at: datetime
    groups: tuple[GroupFacts, ...]
    stuck: tuple[StuckFacts, ...]
    findings: tuple[Finding, ...]
    #: The server's synchronous standbys (:mod:`pgonce.core.durability`), when they were read.
    durability: Durability | None = None
    #: The oldest transaction holding the MVCC horizon back (:mod:`pgonce.core.mvcc`), when read.
    mvcc: MvccHorizon | None = None

    @property
    def status(self) -> Status:
        worst: Status = "ok"
        for finding in self.findings:
            if _RANK[finding.status] > _RANK[worst]:
                worst = finding.status
        return worst

    @property
    def ok(self) -> bool:
        """False when any check failed (warnings alone keep it true)."""
        return self.status != "fail"


def assess(
    checked_at: datetime,
    groups: Iterable[GroupFacts],
    stuck: Iterable[StuckFacts],
    *,
    slack: timedelta = DEFAULT_SLACK,
    retired_window: timedelta = DEFAULT_RETIRED_WINDOW,
) -> HealthReport:
    groups = tuple(groups)
    stuck = tuple(stuck)
    findings = [judge_stuck(s) for s in stuck]
    findings.extend(judge_retired(s, retired_window) for s in stuck if s.target == "keys")
    for group in groups:
        findings.extend(judge_horizon(group, slack))
    return HealthReport(checked_at, groups, stuck, tuple(findings))


def judge_schema(current: int, latest: int) -> Finding:
    """The schema's line: the database's last migration against the last this code knows.

    Behind is a failure: every other figure can read fine while a pending migration's index,
    trigger or constraint, which this code counts on, is missing. Ahead is a warning: code older
    than its database (a rolling deploy, a rollback) runs on a schema it was not tested with.
    """
    status: Status = "ok"
    detail = ""
    if current < latest:
        status = "fail"
        detail = (
            f"{latest - current} migration(s) this code needs are not applied: run "
            "`pgonce migrate` on this database"
        )
    elif current > latest:
        status = "warn"
        detail = (
            "the database was migrated by a newer pgonce than this one: upgrade this process, "
            "or expect it to miss what the newer migrations changed"
        )
    return Finding("schema version", "database", None, status, str(current), f"{latest}", detail)


#: A timeout shorter than this cuts pgonce's own work in ordinary operation, so it is warned about.
#: Each of pgonce's statements is an index probe or a small batch (milliseconds when quiet), but
#: under load one waits: a claim on the row lock of a concurrent claim of the same key, any
#: statement on a checkpoint's I/O or a lock that a migration or vacuum holds for a moment; and a
#: handler's transaction sits idle while the handler works. Under a second, statement_timeout and
#: lock_timeout cut those waits (each cut delivery answered 503, each cut batch retried, again and
#: again), and idle_in_transaction_session_timeout closes the connection of a handler that takes
#: longer. A bound of seconds or more is a deliberate choice this check leaves alone.
SHORT_TIMEOUT = timedelta(seconds=1)


@refuse_changes
@dataclass(frozen=True, slots=True)
class ServerTimeout:
    """One timeout as a new connection of this role to this database gets it, and where it is
    set (``pg_db_role_setting``): what an application's connections run under, not the health
    check's own."""

    #: statement_timeout, lock_timeout or idle_in_transaction_session_timeout.
    name: str
    #: Its value in milliseconds; 0 is none.
    ms: int
    #: Who sets it: the role of ``ALTER ROLE ... SET`` and the database of ``ALTER DATABASE ...
    #: SET`` (both for ``ALTER ROLE ... IN DATABASE ... SET``); both None when neither does
    #: (postgresql.conf, or the connection's own options).
    role: str | None = None
    database: str | None = None
    #: The value as it was written there (``'1ms'``).
    configured: str | None = None


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _where_set(t: ServerTimeout) -> tuple[str, str]:
    """Where the setting comes from, and the statement that removes it there."""
    if t.role is not None and t.database is not None:
        return (
            f"set for role {t.role!r} in database {t.database!r}",
            f"ALTER ROLE {_ident(t.role)} IN DATABASE {_ident(t.database)} RESET {t.name}",
        )
    if t.role is not None:
        return f"set for role {t.role!r}", f"ALTER ROLE {_ident(t.role)} RESET {t.name}"
    if t.database is not None:
        return (
            f"set for database {t.database!r}",
            f"ALTER DATABASE {_ident(t.database)} RESET {t.name} (or give pgonce's role a "
            f"longer one, which overrides the database's: ALTER ROLE ... IN DATABASE "
            f"{_ident(t.database)} SET {t.name} = '30s')",
        )
    return (
        "set neither for the database nor for the role, so by postgresql.conf or the "
        "connection's options (PGOPTIONS, options= in the DSN)",
        f"raise it there, or give pgonce's role its own with ALTER ROLE ... SET {t.name} = '30s'",
    )


def judge_server_timeouts(
    timeouts: Iterable[ServerTimeout], short: timedelta = SHORT_TIMEOUT
) -> Finding:
    """The timeouts line: a warning for each timeout that a new connection gets and that is
    shorter than ``short``, with its value, where it is set and how to change it.

    The health check sets its own statement timeout, so its figures read fine under a database's
    ``statement_timeout = '1ms'`` that cuts every statement of the service: this line reads what
    the service's connections get.
    """
    limit = f"none under {format_duration(short)}"
    cut = [t for t in timeouts if 0 < t.ms < short.total_seconds() * 1000]
    if not cut:
        return Finding("server timeouts", "database", None, "ok", "none short", limit, "")
    value = ", ".join(f"{t.name} {t.ms}ms" for t in cut)
    parts = []
    for t in cut:
        where, change = _where_set(t)
        shown = t.configured not in (None, f"{t.ms}ms", str(t.ms))
        written = f" (set as {t.configured!r})" if shown else ""
        parts.append(f"{t.name} is {t.ms}ms{written}, {where}: {change}")
    detail = (
        "; ".join(parts)
        + f". Under {format_duration(short)} it cuts pgonce's own statements in ordinary "
        "operation (a claim waiting on a concurrent claim's row lock, a batch waiting on I/O, a "
        "handler's transaction idle while the handler works): deliveries are answered 503 and "
        "batches retried while this check, under its own timeout, reads fine"
    )
    return Finding("server timeouts", "database", None, "warn", value, limit, detail)
