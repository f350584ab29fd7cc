"""Replay what gave up: dead-lettered inbox events, or parked outbox rows.

Inbox (--source): dead events go back to pending with a fresh retry budget (attempts start again
at zero), due at once; the last error stays on the row for the record. The workers are woken.
Outbox (--outbox): parked rows go back to the relay's queue, due at once, attempts reset; the
relays are woken. Replaying is safe to repeat: only rows that are dead (or parked) when the
command runs are touched, in one transaction.

Examples:
  pgonce replay --source stripe                        # every dead letter of the source
  pgonce replay --source stripe --event-id evt_1 --event-id evt_2
  pgonce replay --outbox                               # every parked outbox row
  pgonce replay --outbox --id 42 --id 43               # or by id, or --aggregatetype order

Prints each replayed id on stdout and a count on stderr. Exit status: 0 when something was
replayed, 1 when nothing matched (so scripts notice a mistyped id). A schema that `pgonce migrate`
has not created (a mistyped --schema) is refused, never created.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from pgonce.cli.common import (
    add_database_options,
    bounded_int,
    command_connection,
    database,
    printable,
    require_migrated,
    say,
)
from pgonce.store._sync.inbox import InboxStore
from pgonce.store._sync.outbox import OutboxStore
from pgonce.store.errors import translate_errors

NAME = "replay"
HELP = "replay dead-lettered inbox events or parked outbox rows"


def configure(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--source", type=_named, help="replay dead inbox events of this webhook source"
    )
    which.add_argument("--outbox", action="store_true", help="replay parked outbox rows")
    parser.add_argument(
        "--event-id",
        action="append",
        dest="event_ids",
        type=_named,
        metavar="ID",
        help="with --source: only this event (repeatable; default: every dead letter)",
    )
    parser.add_argument(
        "--id",
        action="append",
        dest="ids",
        type=bounded_int(1, 2**63 - 1),
        metavar="N",
        help="with --outbox: only this row id (repeatable; default: every parked row)",
    )
    parser.add_argument(
        "--aggregatetype", type=_named, help="with --outbox: only rows of this aggregate type"
    )


def _named(text: str) -> str:
    """An argparse type for a source, an event id or an aggregate type: never empty. An empty
    one was refused only after connecting, with exit 1 as if the database had failed."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


@contextlib.contextmanager
def _migrated(dsn: str, schema: str) -> Iterator[None]:
    require_migrated(dsn, schema)
    yield


def run(args: argparse.Namespace) -> int:
    if args.outbox and args.event_ids:
        args.parser.error("--event-id goes with --source; use --id with --outbox")
    if args.source and (args.ids or args.aggregatetype):
        args.parser.error("--id and --aggregatetype go with --outbox")
    with (
        database(args, migrated=False) as (settings, db),
        _migrated(db.dsn, settings.schema),
        translate_errors("connecting"),
        command_connection(db.dsn, autocommit=False) as conn,
        conn.transaction(),
    ):
        if args.outbox:
            replayed: list[str] = [
                str(i)
                for i in OutboxStore(schema=settings.schema).replay(
                    conn, ids=args.ids, aggregatetype=args.aggregatetype
                )
            ]
            what = "parked outbox row(s)"
        else:
            replayed = InboxStore(schema=settings.schema).replay(conn, args.source, args.event_ids)
            what = f"dead inbox event(s) of source {args.source}"
    for item in replayed:
        print(printable(item))
    say(f"pgonce: replayed {len(replayed)} {what}")
    return 0 if replayed else 1
