"""Delete expired rows once, in bounded batches: the run for cron.

Every sweep target (--target: keys, inbox, outbox, outbox_aggregates) is swept in batches, each
its own short transaction with a statement timeout, pausing between batches, until the first short
batch or the batch cap. What goes, once older than its retention: completed keys (never a claim in
flight); handled inbox events (never a pending event or a dead letter); published outbox rows
(never a row waiting for the broker, nor a parked one); the lock rows of outbox aggregates idle
for the retention. Several sweeps may run at once (from cron on several hosts): they take disjoint
rows.

The retention comes from the options, else from the configuration file (--config or
$PGONCE_CONFIG: [keys], each [sources.NAME] and [outbox] retention, as the service's own sweeper
uses them), else from the defaults. A retention shorter than the retry horizon it must cover is
refused before anything is deleted.

--dry-run counts what would be deleted and deletes nothing. --now judges ages as of another time;
a time later than the database's clock is refused without --dry-run, as it would delete rows
that are still kept.

On a terminal a progress line runs on stderr and the final count ends it; otherwise (cron) only the
final line is printed, on stdout, and --quiet prints nothing at all unless something fails.
Exit status: 0 when the run finished (also when the batch cap ended it: the next run continues),
1 on an error. A run that fails midway says how many rows it had already deleted (its batches
committed before the failure stay deleted; the next run continues from there). A schema that
`pgonce migrate` has not created (a mistyped --schema) is refused before any batch runs, and so is
a node that takes no writes (a standby, default_transaction_read_only): one error says to sweep
against the primary, exit 1; --dry-run still counts there.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg

from pgonce.cli.common import (
    add_database_options,
    announced_database,
    bounded_int,
    command_connection,
    config_from,
    require_migrated,
    settings_from,
    takes_no_writes,
)
from pgonce.core.durability import READ_ONLY_DETAIL
from pgonce.core.retention import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_BATCHES,
    DEFAULT_PAUSE,
    DEFAULT_RETENTION,
    DEFAULT_RETRY_HORIZON,
    DEFAULT_STATEMENT_TIMEOUT,
    MAX_PAUSE,
    TARGETS,
    RetentionPolicy,
    SweepLimits,
    format_duration,
    parse_duration,
    policy_from_text,
    scope_retention,
)
from pgonce.errors import ConfigError, DatabaseError, DatabaseUnavailable, UsageError
from pgonce.sql import Queries
from pgonce.store._sync.health import HealthCheck
from pgonce.store._sync.sweeper import Sweeper, failure_summary, swept_before
from pgonce.store.cursors import cursor
from pgonce.store.errors import translate_errors

if TYPE_CHECKING:
    from pgonce.service.config import ServiceConfig

NAME = "sweep"
HELP = "delete expired keys in bounded batches (one run, for cron)"


def duration_arg(text: str) -> timedelta:
    """An argparse type for durations (30d, 72h, 15m, 500ms)."""
    try:
        return parse_duration(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_duration_arg(text: str) -> timedelta:
    """An argparse type for a duration that means nothing at zero (a retention, a timeout)."""
    duration = duration_arg(text)
    if duration <= timedelta(0):
        raise argparse.ArgumentTypeError(f"{text!r} is not longer than 0s")
    return duration


#: The longest age an option may give (a retention, a retry horizon, --stuck-after, --slack):
#: the checks and the sweep date rows back by it from now, and PostgreSQL's timestamps end in
#: 4713 BC. A thousand years is more than any retention means; beyond PostgreSQL's range, the
#: run failed after connecting with "timestamp out of range".
LONGEST_AGE = timedelta(days=365_250)


def _within_ages(text: str, duration: timedelta) -> timedelta:
    if duration > LONGEST_AGE:
        raise argparse.ArgumentTypeError(
            f"{text!r} is longer than the longest age pgonce takes, a thousand years "
            f"({format_duration(LONGEST_AGE)})"
        )
    return duration


def age_arg(text: str) -> timedelta:
    """An argparse type for an age rows are judged by (--stuck-after, --slack)."""
    return _within_ages(text, duration_arg(text))


def positive_age_arg(text: str) -> timedelta:
    """An argparse type for an age that means nothing at zero (a retention, a retry horizon)."""
    return _within_ages(text, positive_duration_arg(text))


#: PostgreSQL's largest statement_timeout, 2**31 - 1 milliseconds.
_LONGEST_STATEMENT_TIMEOUT = timedelta(milliseconds=2**31 - 1)


def statement_timeout_arg(text: str) -> timedelta:
    """A statement timeout (a sweep batch's, doctor's checks'): PostgreSQL takes at most
    2**31 - 1 ms (24 days)."""
    duration = positive_duration_arg(text)
    if duration > _LONGEST_STATEMENT_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"{text!r} is longer than PostgreSQL's longest statement timeout, 24 days"
        )
    return duration


def _pause_arg(text: str) -> timedelta:
    duration = duration_arg(text)
    if duration > MAX_PAUSE:
        raise argparse.ArgumentTypeError(
            f"{text!r} is longer than {format_duration(MAX_PAUSE)}: the pause is a rest "
            "between two batches of one run; schedule runs with cron"
        )
    return duration


def _env_duration(name: str) -> timedelta | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        duration = parse_duration(text)
    except ConfigError as error:
        raise ConfigError(f"{name}: {error}") from None
    if duration <= timedelta(0):
        raise ConfigError(f"{name}: {text!r} is not longer than 0s")
    return duration


def _moment(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO 8601 time (e.g. 2026-01-31T12:00:00Z)"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _scope_retention(text: str) -> str:
    """A ``SCOPE=RETENTION[/HORIZON]`` word, read as :func:`policy_from_text` reads it: one that
    does not read is a usage error at the call. Whether it covers its retry horizon is judged
    with the other options, by the policy."""
    try:
        _, retention = scope_retention(text, DEFAULT_RETRY_HORIZON)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    _within_ages(text, max(retention.keep, retention.retry_horizon))
    return text


class _AppendOnce(argparse.Action):
    """``append`` that keeps each value once: ``--target keys --target keys`` sweeps (and
    checks) the table once, not twice."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = list(getattr(namespace, self.dest, None) or [])
        if values not in given:
            given.append(values)
        setattr(namespace, self.dest, given)


class _ScopeOnce(argparse.Action):
    """``append`` for ``--scope-retention``: a scope given twice is a usage error. The last one
    won without a word, so that a retention typed again lower (s=90d, later s=1d) deleted rows
    the first one kept."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = list(getattr(namespace, self.dest, None) or [])
        scope = str(values).partition("=")[0]
        if any(item.partition("=")[0] == scope for item in given):
            parser.error(f"argument {option_string}: scope {scope!r} is given twice")
        given.append(values)
        setattr(namespace, self.dest, given)


def add_retention_options(parser: argparse.ArgumentParser) -> None:
    """The retention options ``pgonce sweep`` and ``pgonce doctor`` share."""
    group = parser.add_argument_group("retention")
    group.add_argument(
        "--retention",
        type=positive_age_arg,
        metavar="DURATION",
        help="how long completed rows are kept, e.g. 30d, 72h (default: $PGONCE_RETENTION, else "
        "the configuration file's retention of each table and source, else "
        f"{format_duration(DEFAULT_RETENTION)}: ten times the longest common provider retry "
        "horizon, and a month of answers for support)",
    )
    group.add_argument(
        "--retry-horizon",
        type=positive_age_arg,
        metavar="DURATION",
        help="how long senders keep retrying a key; the retention must cover it (default: "
        "$PGONCE_RETRY_HORIZON, else the configuration file's, else "
        f"{format_duration(DEFAULT_RETRY_HORIZON)}, Stripe's 3 days)",
    )
    group.add_argument(
        "--scope-retention",
        action=_ScopeOnce,
        default=[],
        type=_scope_retention,
        metavar="SCOPE=RETENTION[/HORIZON]",
        help="a scope (or webhook source) with its own retention and optionally its own retry "
        "horizon, e.g. stripe=30d/3d; repeat for more",
    )
    group.add_argument(
        "--target",
        action=_AppendOnce,
        choices=sorted(TARGETS),
        help="sweep only this table; repeat for more (default: all of them)",
    )
    group.add_argument(
        "--now",
        type=_moment,
        metavar="TIME",
        help="judge ages as of this ISO 8601 time instead of the server's clock; pgonce sweep "
        "refuses a time later than the server's unless --dry-run is given",
    )


def policies_from(
    args: argparse.Namespace, config: ServiceConfig | None = None
) -> list[RetentionPolicy]:
    """One policy per target: the options, else the environment, else the configuration's
    policies (``config``), else the defaults. Raises ConfigError from the horizon guard."""
    names = args.target or list(TARGETS)
    keep = args.retention if args.retention is not None else _env_duration("PGONCE_RETENTION")
    horizon = (
        args.retry_horizon
        if args.retry_horizon is not None
        else _env_duration("PGONCE_RETRY_HORIZON")
    )
    configured = {p.target: p for p in (config.retention_policies() if config else [])}
    policies = []
    for name in names:
        base = configured.get(name) or RetentionPolicy(name)
        given = policy_from_text(
            name,
            keep=base.default.keep if keep is None else keep,
            retry_horizon=base.default.retry_horizon if horizon is None else horizon,
            overrides=args.scope_retention,
        )
        policies.append(replace(given, scopes={**base.scopes, **given.scopes}))
    return policies


def configure(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    add_retention_options(parser)
    group = parser.add_argument_group("batches")
    group.add_argument(
        "--batch-size",
        type=bounded_int(1, 2**63 - 1),
        default=DEFAULT_BATCH_SIZE,
        help=f"rows per batch, each its own transaction (default {DEFAULT_BATCH_SIZE:,})",
    )
    group.add_argument(
        "--max-batches",
        type=bounded_int(1),
        default=DEFAULT_MAX_BATCHES,
        help=f"batches per table and run; the next run continues (default {DEFAULT_MAX_BATCHES:,})",
    )
    group.add_argument(
        "--pause",
        type=_pause_arg,
        default=format_duration(DEFAULT_PAUSE),
        metavar="DURATION",
        help=f"pause between batches (default {format_duration(DEFAULT_PAUSE)})",
    )
    group.add_argument(
        "--statement-timeout",
        type=statement_timeout_arg,
        default=format_duration(DEFAULT_STATEMENT_TIMEOUT),
        metavar="DURATION",
        help="statement timeout of one batch "
        f"(default {format_duration(DEFAULT_STATEMENT_TIMEOUT)})",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="count the rows that would be deleted, and delete nothing",
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing unless something fails"
    )


class Progress:
    """A progress line on a terminal (stderr, rewritten in place); nothing elsewhere."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.deleted: dict[str, int] = {}
        self.batches = 0

    def __call__(self, target: str, deleted: int) -> None:
        self.deleted[target] = self.deleted.get(target, 0) + deleted
        self.batches += 1
        if self.enabled:
            done = ", ".join(f"{name} {count:,}" for name, count in self.deleted.items())
            print(f"\rpgonce sweep: {done} rows, {self.batches:,} batches", end="", file=sys.stderr)

    def close(self) -> None:
        if self.enabled and self.batches:
            print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    settings = settings_from(args, config)
    policies = policies_from(args, config)
    sweeper = Sweeper(
        policies,
        schema=settings.schema,
        targets=args.target,
        limits=SweepLimits(
            batch_size=args.batch_size,
            max_batches=args.max_batches,
            pause=args.pause,
            statement_timeout=args.statement_timeout,
        ),
    )
    interactive = sys.stderr.isatty() and not args.quiet
    progress = Progress(interactive)
    with (
        announced_database(settings, quiet=not interactive) as db,
        translate_errors("connecting"),
        command_connection(db.dsn) as conn,
    ):
        require_migrated(db.dsn, settings.schema)
        if args.dry_run:
            report = HealthCheck(policies, schema=settings.schema, targets=args.target).check(
                conn, now=args.now
            )
            counts: dict[str, int] = {}
            for group in report.groups:
                counts[group.target] = counts.get(group.target, 0) + group.overdue
            print(
                f"dry run: {sum(counts.values()):,} rows would be deleted as of "
                f"{report.checked_at:%Y-%m-%d %H:%M:%S %Z} ("
                + ", ".join(f"{name} {count:,}" for name, count in counts.items())
                + "); nothing was deleted",
                flush=True,
            )
            return 0
        if takes_no_writes(conn):
            # Every target's DELETE was refused on its own: a warning per table, then an error
            # naming the first one, where the one thing to say is which node to sweep.
            raise DatabaseUnavailable(
                f"sweeping failed: the node is read-only and a sweep deletes rows: "
                f"{READ_ONLY_DETAIL} (--dry-run only counts, and runs here too)"
            )
        if args.now is not None:
            clock = database_clock(conn, settings.schema)
            if args.now > clock:
                raise UsageError(
                    f"--now {args.now:%Y-%m-%d %H:%M:%S %Z} is later than the database's clock "
                    f"({clock:%Y-%m-%d %H:%M:%S %Z}): sweeping as of then would delete rows that "
                    "are still kept; add --dry-run to count them instead"
                )
        try:
            result = sweeper.sweep(conn, now=args.now, on_batch=progress)
        except DatabaseError as error:
            if swept_before(error) is None:
                raise
            # Same error class and exit status, with what the committed batches deleted: the
            # bare error read as if the run had deleted nothing.
            raise type(error)(failure_summary(error)) from error
        finally:
            progress.close()
    if not args.quiet:
        print(result.summary(), flush=True)
    return 0


def database_clock(conn: psycopg.Connection[Any], schema: str) -> datetime:
    """The database's ``now()``."""
    with translate_errors("reading the clock"):
        row = cursor(conn).execute(Queries("health", schema).clock, {"now": None}).fetchone()
    assert row is not None
    moment: datetime = row[0]
    return moment
