"""Put dead-lettered inbox events back to pending, so the workers run their handlers again.

A replayed event gets a fresh retry budget (its attempts start again at zero) and is due at once;
its last error stays on the row for the record. The workers are woken by a notification. Replaying
is safe to repeat: only events that are dead when the command runs are touched.

Examples:
  pgonce inbox-replay --source stripe                  # every dead letter of the source
  pgonce inbox-replay --source stripe --event-id evt_1 --event-id evt_2

Prints each replayed event id on stdout and a count on stderr. Exit status: 0 when something was
replayed, 1 when nothing matched (so scripts notice a mistyped id).
"""

from __future__ import annotations

import argparse

import psycopg

from pgonce.cli.common import add_database_options, database, say
from pgonce.store._sync.inbox import InboxStore
from pgonce.store.errors import translate_errors

NAME = "inbox-replay"
HELP = "replay dead-lettered webhook inbox events"


def configure(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    parser.add_argument("--source", required=True, help="the webhook source whose events to replay")
    parser.add_argument(
        "--event-id",
        action="append",
        dest="event_ids",
        metavar="ID",
        help="replay only this event (repeatable; default: every dead letter of the source)",
    )


def run(args: argparse.Namespace) -> int:
    with database(args) as (settings, db):
        store = InboxStore(schema=settings.schema)
        with (
            translate_errors("connecting"),
            psycopg.connect(db.dsn) as conn,
            conn.transaction(),
        ):
            replayed = store.replay(conn, args.source, args.event_ids)
    for event_id in replayed:
        print(event_id)
    say(f"pgonce: replayed {len(replayed)} dead inbox event(s) of source {args.source}")
    return 0 if replayed else 1
