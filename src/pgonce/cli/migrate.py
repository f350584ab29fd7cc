"""Apply pgonce's pending migrations to the database.

Each migration runs in its own transaction and is recorded in <schema>.schema_migrations. Concurrent
runs are serialized: each migration is applied exactly once. When up to date it does nothing: on
a node that takes no writes (a standby, default_transaction_read_only) it reads the ledger and
says so, where pending migrations are refused with an error naming the node as read-only.

With --status it only reports the schema's version and applies nothing.
Exit status: 0 when the schema is up to date (or was brought up to date); with --status, 1 when
migrations are pending (so that a deploy script can wait for them); 1 on an error, such as a
schema that a newer pgonce migrated (nothing is applied or undone then). Output whose reader is
gone (``pgonce migrate | head -1``) does not stop the migrations: they are all applied, and the exit
status is 1, as for every command whose output was lost.
"""

from __future__ import annotations

import argparse

from pgonce.cli.common import (
    add_database_options,
    announced_database,
    command_connection,
    settings_from,
    takes_no_writes,
)
from pgonce.store.errors import translate_errors
from pgonce.store.migrate import migrate, newer_schema_error, pending, status

NAME = "migrate"
HELP = "apply pending migrations"


def configure(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    parser.add_argument(
        "--status",
        action="store_true",
        help="only print the current and latest version; exit 1 when migrations are pending",
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    lines = _Lines()
    with (
        announced_database(settings) as db,
        translate_errors("connecting"),
        command_connection(db.dsn) as conn,
    ):
        state = status(conn, settings.schema)
        if state.newer:
            # "Pending" would have a deploy script wait for ever; "up to date" would hide that
            # this pgonce is older than the database.
            raise newer_schema_error(settings.schema, state)
        if args.status:
            behind = "" if state.up_to_date else "; migrations pending: run pgonce migrate"
            print(f"schema {settings.schema}: version {state.current} of {state.latest}{behind}")
            return 0 if state.up_to_date else 1
        if takes_no_writes(conn) and not pending(conn, settings.schema):
            # migrate() creates the schema and its ledger first, under the runners' lock,
            # which a read-only node or a standby refuses even when there is nothing to apply.
            # The ledger, read without a write, says there is nothing: so does this. A node
            # that takes writes goes through migrate() as ever (it waits for a runner that
            # holds the lock, then finds nothing to do).
            print(f"schema {settings.schema} is up to date (version {state.current})")
            return 0
        applied = migrate(
            conn,
            settings.schema,
            on_applied=lines.applied,
        )
        state = status(conn, settings.schema)
    if lines.lost:
        return 1
    if not applied:
        print(f"schema {settings.schema} is up to date (version {state.current})")
    return 0


class _Lines:
    """One line per migration applied, on stdout. A reader that went away stops the lines, never
    the migrations: raised from the migrations' callback, it ended the run halfway (version 2 of
    20) and said nothing. ``lost`` tells that output was lost, so that the command still exits 1
    as every command whose output was lost does (see pgonce.cli)."""

    def __init__(self) -> None:
        self.lost = False

    def applied(self, version: int, name: str) -> None:
        if self.lost:
            return
        try:
            print(f"applied {version:04d}_{name}", flush=True)
        except BrokenPipeError:
            from pgonce.cli import reader_gone

            self.lost = True
            reader_gone()  # stdout now goes nowhere: nothing more to report at exit
