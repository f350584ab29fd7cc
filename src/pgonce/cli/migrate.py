"""Apply pgonce's pending migrations to the database.

Each migration runs in its own transaction and is recorded in <schema>.schema_migrations. Concurrent
runs are serialized: each migration is applied exactly once. When up to date it does nothing.

With --status it only reports the schema's version and applies nothing.
Exit status: 0 when the schema is up to date (or was brought up to date); with --status, 1 when
migrations are pending (so that a deploy script can wait for them); 1 on an error, such as a
schema that a newer pgonce migrated (nothing is applied or undone then).
"""

from __future__ import annotations

import argparse

import psycopg

from pgonce.cli.common import add_database_options, announced_database, settings_from
from pgonce.store.errors import translate_errors
from pgonce.store.migrate import migrate, newer_schema_error, status

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
    with (
        announced_database(settings) as db,
        translate_errors("connecting"),
        psycopg.connect(db.dsn, autocommit=True) as conn,
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
        applied = migrate(
            conn,
            settings.schema,
            on_applied=lambda version, name: print(f"applied {version:04d}_{name}"),
        )
        state = status(conn, settings.schema)
    if not applied:
        print(f"schema {settings.schema} is up to date (version {state.current})")
    return 0
