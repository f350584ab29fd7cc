"""Delete expired rows once, in bounded batches: the run for cron.

Every sweep target (--target: keys, inbox, outbox, outbox_aggregates) is swept in batches, each
its own short transaction with a statement timeout, pausing between batches, until the first short
batch or the batch cap. What goes, once older than its retention: completed keys (never a claim in
flight); handled inbox events (never a pending event or a dead letter); published outbox rows
(never a row waiting for the broker, nor a parked one); the lock rows of outbox aggregates idle
for the retention. Several sweeps may run at once (from cron on several hosts): they take disjoint
rows.

A retention shorter than the retry horizon it must cover is refused before anything is deleted.

On a terminal a progress line runs on stderr and the final count ends it; otherwise (cron) only the
final line is printed, on stdout, and --quiet prints nothing at all unless something fails.
Exit status: 0 when the run finished (also when the batch cap ended it: the next run continues),
1 on an error.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime, timedelta

import psycopg

from pgonce.cli.common import add_database_options, announced_database, settings_from
from pgonce.core.retention import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_BATCHES,
    DEFAULT_PAUSE,
    DEFAULT_RETENTION,
    DEFAULT_RETRY_HORIZON,
    DEFAULT_STATEMENT_TIMEOUT,
    TARGETS,
    RetentionPolicy,
    SweepLimits,
    format_duration,
    parse_duration,
    policy_from_text,
)
from pgonce.errors import ConfigError
from pgonce.store._sync.sweeper import Sweeper
from pgonce.store.errors import translate_errors

NAME = "sweep"
HELP = "delete expired keys in bounded batches (one run, for cron)"


def duration_arg(text: str) -> timedelta:
    """An argparse type for durations (30d, 72h, 15m, 500ms)."""
    try:
        return parse_duration(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _moment(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO 8601 time (e.g. 2026-01-31T12:00:00Z)"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def add_retention_options(parser: argparse.ArgumentParser) -> None:
    """The retention options ``pgonce sweep`` and ``pgonce doctor`` share."""
    group = parser.add_argument_group("retention")
    group.add_argument(
        "--retention",
        type=duration_arg,
        default=os.environ.get("PGONCE_RETENTION") or format_duration(DEFAULT_RETENTION),
        metavar="DURATION",
        help="how long completed rows are kept, e.g. 30d, 72h (default: $PGONCE_RETENTION or "
        f"{format_duration(DEFAULT_RETENTION)}: ten times the longest common provider retry "
        "horizon, and a month of answers for support)",
    )
    group.add_argument(
        "--retry-horizon",
        type=duration_arg,
        default=os.environ.get("PGONCE_RETRY_HORIZON") or format_duration(DEFAULT_RETRY_HORIZON),
        metavar="DURATION",
        help="how long senders keep retrying a key; the retention must cover it (default: "
        f"$PGONCE_RETRY_HORIZON or {format_duration(DEFAULT_RETRY_HORIZON)}, Stripe's 3 days)",
    )
    group.add_argument(
        "--scope-retention",
        action="append",
        default=[],
        metavar="SCOPE=RETENTION[/HORIZON]",
        help="a scope (or webhook source) with its own retention and optionally its own retry "
        "horizon, e.g. stripe=30d/3d; repeat for more",
    )
    group.add_argument(
        "--target",
        action="append",
        choices=sorted(TARGETS),
        help="sweep only this table; repeat for more (default: all of them)",
    )
    group.add_argument(
        "--now",
        type=_moment,
        metavar="TIME",
        help="judge ages as of this ISO 8601 time instead of the server's clock (tests, what-ifs)",
    )


def policies_from(args: argparse.Namespace) -> list[RetentionPolicy]:
    """One policy per target from the options; raises ConfigError from the horizon guard."""
    names = args.target or list(TARGETS)
    return [
        policy_from_text(
            name,
            keep=args.retention,
            retry_horizon=args.retry_horizon,
            overrides=args.scope_retention,
        )
        for name in names
    ]


def configure(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    add_retention_options(parser)
    group = parser.add_argument_group("batches")
    group.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help=f"rows per batch, each its own transaction (default {DEFAULT_BATCH_SIZE:,})",
    )
    group.add_argument(
        "--max-batches",
        type=int,
        default=DEFAULT_MAX_BATCHES,
        help=f"batches per table and run; the next run continues (default {DEFAULT_MAX_BATCHES:,})",
    )
    group.add_argument(
        "--pause",
        type=duration_arg,
        default=format_duration(DEFAULT_PAUSE),
        metavar="DURATION",
        help=f"pause between batches (default {format_duration(DEFAULT_PAUSE)})",
    )
    group.add_argument(
        "--statement-timeout",
        type=duration_arg,
        default=format_duration(DEFAULT_STATEMENT_TIMEOUT),
        metavar="DURATION",
        help="statement timeout of one batch "
        f"(default {format_duration(DEFAULT_STATEMENT_TIMEOUT)})",
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
    sweeper = Sweeper(
        policies_from(args),
        schema=settings_from(args).schema,
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
        announced_database(settings_from(args), quiet=not interactive) as db,
        translate_errors("connecting"),
        psycopg.connect(db.dsn, autocommit=True) as conn,
    ):
        try:
            result = sweeper.sweep(conn, now=args.now, on_batch=progress)
        finally:
            progress.close()
    if not args.quiet:
        print(result.summary(), flush=True)
    return 0
