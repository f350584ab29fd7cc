"""List stored webhook events, or show one in full.

Newest first, filtered by source, status (pending, done, dead, skipped) and event id. With --show
and one --id (and --source), prints the event's bookkeeping, headers and body. Bodies are printed
as text when they are UTF-8, else as a hex dump of their start.

Examples:
  pgonce events --status dead
  pgonce events --source shop --id evt_123 --show
"""

from __future__ import annotations

import argparse

from pgonce.cli.common import add_database_options, command_connection, database, printable
from pgonce.store._sync.inspect import MAX_LIST, Inspector
from pgonce.store.errors import translate_errors

NAME = "events"
HELP = "list stored webhook events, or show one"
STATUSES = ("pending", "done", "dead", "skipped")


def configure(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    parser.add_argument("--source", help="only this source")
    parser.add_argument("--status", choices=STATUSES, help="only events in this status")
    parser.add_argument("--id", dest="event_id", help="only this event id")
    parser.add_argument(
        "--limit",
        type=_limit,
        default=50,
        help=f"at most this many (default 50, at most {MAX_LIST})",
    )
    parser.add_argument(
        "--show", action="store_true", help="print one event in full (needs --source and --id)"
    )


def _limit(text: str) -> int:
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    if limit > MAX_LIST:
        # The listing stops at MAX_LIST rows: a larger limit was cut to it without a word.
        raise argparse.ArgumentTypeError(
            f"{text!r} is more than {MAX_LIST}, the most rows a listing shows: filter with "
            "--source, --status or --id instead"
        )
    return limit


def _when(value: object) -> str:
    return "" if value is None else str(value)[:19]


def run(args: argparse.Namespace) -> int:
    if args.show and not (args.source and args.event_id):
        args.parser.error("--show needs --source and --id")
    with (
        database(args, migrated=False) as (settings, db),
        translate_errors("connecting"),
        command_connection(db.dsn) as conn,
    ):
        inspector = Inspector(schema=settings.schema)
        if args.show:
            event = inspector.event(conn, args.source, args.event_id)
            if event is None:
                print(f"no event {args.event_id!r} from source {args.source!r}")
                return 1
            for label, value in (
                ("source", event.source),
                ("event id", event.event_id),
                ("status", event.status),
                ("attempts", event.attempts),
                ("received", _when(event.received_at)),
                ("processed", _when(event.processed_at)),
                ("ordering key", event.ordering_key or ""),
                ("last error", event.last_error or ""),
                ("body sha-256", event.digest),
            ):
                print(f"{label:>13}: {printable(value)}")
            print("\nheaders:")
            for name, value in sorted(event.headers.items()):
                print(f"  {printable(name)}: {printable(value)}")
            print(f"\nbody ({len(event.body)} bytes):")
            try:
                print(printable(event.body.decode("utf-8"), keep="\n\t"))
            except UnicodeDecodeError:
                print(event.body[:512].hex(" ", 2))
            return 0
        found = inspector.events(
            conn, source=args.source, status=args.status, event_id=args.event_id, limit=args.limit
        )
    if not found:
        print("no events match")
        return 0
    print(f"{'received':<19}  {'source':<12} {'status':<8} {'tries':>5}  event id / last error")
    for e in found:
        print(
            f"{_when(e.received_at):<19}  {printable(e.source):<12.12} {e.status:<8} "
            f"{e.attempts:>5}  {printable(e.event_id)}"
        )
        if e.last_error:
            print(f"{'':<49}{printable(e.last_error[:100])}")
    return 0
