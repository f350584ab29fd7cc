"""What the commands share: database options, and opening the database they name."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import psycopg

from pgonce.config import Settings
from pgonce.database import Database, open_database
from pgonce.store.errors import translate_errors
from pgonce.store.migrate import migrate


class Command(Protocol):
    NAME: str
    HELP: str
    __doc__: str | None

    def configure(self, parser: argparse.ArgumentParser) -> None: ...
    def run(self, args: argparse.Namespace) -> int: ...


def add_database_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("database")
    group.add_argument(
        "--dsn",
        help="PostgreSQL connection string (default: $PGONCE_DSN; none: the embedded server)",
    )
    group.add_argument(
        "--schema", help="schema of pgonce's tables (default: $PGONCE_SCHEMA or pgonce)"
    )
    group.add_argument(
        "--data-dir",
        type=Path,
        help="data folder of the embedded server (default: $PGONCE_DATA_DIR or .pgonce/data)",
    )


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings.from_env(
        dsn=getattr(args, "dsn", None),
        schema=getattr(args, "schema", None),
        data_dir=getattr(args, "data_dir", None),
    )


def say(message: str) -> None:
    """A line for the person at the terminal, on stderr so that stdout stays for data."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def database(
    args: argparse.Namespace, *, migrated: bool = True
) -> Iterator[tuple[Settings, Database]]:
    """Open the database the options name, say which one it is, and migrate it if asked."""
    settings = settings_from(args)
    with open_database(settings) as db:
        say(f"pgonce: using {db.description}")
        if migrated:
            with translate_errors("connecting"), psycopg.connect(db.dsn, autocommit=True) as conn:
                applied = migrate(conn, settings.schema)
            if applied:
                say(f"pgonce: applied migrations {', '.join(f'{v:04d}' for v in applied)}")
        yield settings, db


def print_proof(
    rows: list[tuple[str, object, str]], *, seconds: float, items: int, ok: bool
) -> None:
    """The exactly-once proof as the demos print it: a table, a rate, and the verdict."""
    print()
    for label, value, note in rows:
        print(f"  {label:<20} {value!s:>6}   {note}".rstrip())
    print(f"\n  {items / seconds:,.0f} deliveries/s in {seconds:.2f} s")
    print(f"\nexactly once: {'yes' if ok else 'NO'}")
