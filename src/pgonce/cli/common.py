"""What the commands share: database options, and opening the database they name."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import psycopg

from pgonce.config import Settings
from pgonce.database import (
    ANSWER_TIMEOUT,
    CONNECT_TIMEOUT,
    Database,
    answered_in_time,
    embedded_notice,
    load_embedded,
    open_database,
)
from pgonce.errors import SchemaNotMigrated, UsageError
from pgonce.store.errors import translate_errors
from pgonce.store.migrate import migrate, status

if TYPE_CHECKING:
    from pgonce.service.config import ServiceConfig


class Command(Protocol):
    NAME: str
    HELP: str
    __doc__: str | None

    def configure(self, parser: argparse.ArgumentParser) -> None: ...
    def run(self, args: argparse.Namespace) -> int: ...


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: it unwinds the command as Ctrl-C does (see :func:`stop_on_sigterm`)."""


#: Set while SIGTERM must wait (see :func:`sigterm_deferred`); ``pending`` when one came.
_deferring = {"now": False, "pending": False}


def _terminated(signum: int, frame: object) -> None:
    if _deferring["now"]:
        _deferring["pending"] = True
        return
    raise Terminated


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Hold a SIGTERM back until the block is done, then raise :class:`Terminated`.

    For the start of the embedded PostgreSQL: interrupted there, its ``initdb`` is killed and
    leaves a data folder that every later start refuses ("database postgres does not exist").
    """
    _deferring["now"], _deferring["pending"] = True, False
    try:
        yield
    finally:
        _deferring["now"] = False
    if _deferring["pending"]:
        _deferring["pending"] = False
        raise Terminated


def stop_on_sigterm() -> None:
    """Make SIGTERM (and SIGHUP) raise :class:`Terminated` in the main thread instead of ending
    the process on the spot.

    Killed on the spot, a command leaves behind what it started: the embedded PostgreSQL (it
    kept running, holding the data folder, after a ``docker stop`` during ``pgonce serve``'s
    start), and a statement that the server only learns is abandoned later. Raised like
    KeyboardInterrupt, it closes what the ``with`` blocks opened, and psycopg cancels the
    statement under way as it does on Ctrl-C. A running service replaces this handler with its
    own (stop accepting, finish in-flight work); the event loop puts the default back when it
    closes, so the service calls this again then.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
        if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            # A hang-up (the terminal or SSH session closed) asks for the same: its default
            # ended the command on the spot, the embedded server it had started left running.
            # Ignored (nohup), it stays ignored. The services log it instead (see
            # pgonce.cli.serve.keep_running_on_sighup).
            signal.signal(signal.SIGHUP, _terminated)


#: The options of add_database_options(), by their names in Settings.
DATABASE_OPTIONS = ("dsn", "schema", "data_dir", "require_dsn")


def bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high] (no upper bound without ``high``).

    A count that cannot mean anything is a usage error at the call: ``--copies 0`` would
    otherwise send one copy, ``--demo-copies -1`` fire a storm of nothing and call it a failure,
    and a conformance body limit of 10**12 be built in memory.
    """

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if high is None and number < low:
            raise argparse.ArgumentTypeError(f"{number} is not a whole number of at least {low}")
        if high is not None and not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{number} is not between {low} and {high}")
        return number

    return parse


def http_url(value: str) -> str:
    """An http(s) URL with a host; else a :class:`UsageError` that shows it as
    :func:`pgonce.core.urls.public` does (no password, no query value)."""
    from pgonce.core.urls import public, public_unparsed

    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError when out of 0-65535 or not a number
    except ValueError:
        parts = None
    if parts is None:  # not even split: its whole user part and its query's values are hidden
        raise UsageError(f"{public_unparsed(value)!r} is not an http(s) URL")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{public(value)!r} is not an http(s) URL")
    return value


def not_empty(text: str) -> str:
    """An argparse type: a value that is not empty (``--dsn "$DATABASE_URL"`` with the variable
    unset would otherwise reach libpq's default server, and ``--config ""`` the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty")
    return text


def config_path(text: str) -> Path:
    """An argparse type: the configuration file's path, not empty."""
    return Path(not_empty(text))


def add_global_options(parser: argparse.ArgumentParser) -> None:
    """Options accepted before and after the command: given on both the top-level parser and each
    command's, without a default (argparse.SUPPRESS), so that neither erases the other's value;
    :func:`fill_defaults` sets the ones given nowhere."""
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug details"
    )
    parser.add_argument(
        "--config",
        type=config_path,
        default=argparse.SUPPRESS,
        help="TOML configuration file (default: $PGONCE_CONFIG; none: defaults and environment)",
    )


def add_database_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("database")
    group.add_argument(
        "--dsn",
        type=not_empty,
        default=argparse.SUPPRESS,
        help="PostgreSQL connection string (default: $PGONCE_DSN or [database] dsn; none: the "
        "embedded server)",
    )
    group.add_argument(
        "--schema",
        default=argparse.SUPPRESS,
        help="schema of pgonce's tables (default: $PGONCE_SCHEMA or pgonce)",
    )
    group.add_argument(
        "--data-dir",
        type=Path,
        default=argparse.SUPPRESS,
        help="data folder of the embedded server (default: $PGONCE_DATA_DIR or .pgonce/data)",
    )
    group.add_argument(
        "--require-dsn",
        action="store_true",
        default=argparse.SUPPRESS,
        help="refuse to start without a DSN instead of using the embedded server "
        "(default: $PGONCE_REQUIRE_DSN or [database] require_dsn; set it in production)",
    )


def fill_defaults(args: argparse.Namespace) -> None:
    """Set the global and database options that were given nowhere."""
    for name in ("verbose", "config", *DATABASE_OPTIONS):
        if not hasattr(args, name):
            setattr(args, name, False if name == "verbose" else None)


def config_from(args: argparse.Namespace) -> ServiceConfig | None:
    """The configuration file (--config or $PGONCE_CONFIG) as loaded, or None without one.

    Its database and retention settings only: the commands that take them never read the
    sources' secrets, the broker's URL or the admin token, and run no handler, so a job that runs
    ``pgonce migrate`` or ``pgonce sweep`` need not be given them nor the application's code (see
    :func:`pgonce.service.config.load`).
    """
    if getattr(args, "config", None) is not None or os.environ.get("PGONCE_CONFIG"):
        from pgonce.service.config import load

        return load(getattr(args, "config", None), secrets=False, handlers=False)
    return None


def settings_from(args: argparse.Namespace, config: ServiceConfig | None = None) -> Settings:
    """The database settings: the configuration file's when one is given (``config``, else
    --config or $PGONCE_CONFIG), else the environment's, with the command line's options on top."""
    config = config or config_from(args)
    if config is not None:
        return replace(config.settings, **database_options(args))
    return Settings.from_env(**database_options(args))


def database_options(args: argparse.Namespace) -> dict[str, Any]:
    """The database options given on the command line (those not given are left out)."""
    given = {name: getattr(args, name, None) for name in DATABASE_OPTIONS}
    return {name: value for name, value in given.items() if value is not None}


@contextlib.contextmanager
def announced_database(
    settings: Settings, *, then: str | None = None, quiet: bool = False
) -> Iterator[Database]:
    """:func:`open_database`, saying which database it is on the first line.

    The embedded server is announced before it starts (a first run takes a few seconds), with its
    data folder and that it is not for production data, even when ``quiet``; ``quiet`` drops
    the line for a configured database. ``then`` is a line said after it.
    """
    if settings.dsn is None and not settings.require_dsn:
        load_embedded()  # without the extra, its one-line error comes instead of the notice
        say(f"pgonce: using an {embedded_notice(settings.data_dir)}")
    with contextlib.ExitStack() as stack:
        with sigterm_deferred():
            # A SIGTERM here comes after the start, the server then in the stack to be stopped.
            db = stack.enter_context(open_database(settings))
        if not db.embedded and not quiet:
            say(f"pgonce: using {db.description}")
        if then:
            say(f"pgonce: {then}")
        yield db


def printable(text: object, keep: str = "") -> str:
    """``text`` with its control characters (C0, DEL, C1) but those in ``keep`` written as
    ``\\u001b`` escapes: what a sender wrote must not drive the operator's terminal (an ESC
    sequence clears the screen or hides lines), and a JSON reader reads the escape as the same
    character."""
    return "".join(
        f"\\u{ord(c):04x}" if unicodedata.category(c) == "Cc" and c not in keep else c
        for c in str(text)
    )


def say(message: str) -> None:
    """A line for the person at the terminal, on stderr so that stdout stays for data."""
    print(message, file=sys.stderr, flush=True)


def command_connection(
    dsn: str, *, autocommit: bool = True, connect_timeout: int = CONNECT_TIMEOUT
) -> psycopg.Connection[Any]:
    """A command's own connection to its database, bounded to connect.

    It prepares no statement (psycopg does after five runs of one): behind a transaction-mode
    pooler the next transaction may reach a server session where psycopg's name is another
    client's (``prepared statement "_pg3_0" already exists``, or a statement run under another
    client's name), and a command run once gains nothing from preparing.
    """
    return psycopg.connect(
        dsn, autocommit=autocommit, connect_timeout=connect_timeout, prepare_threshold=None
    )


@contextlib.contextmanager
def database(
    args: argparse.Namespace, *, migrated: bool = True
) -> Iterator[tuple[Settings, Database]]:
    """Open the database the options name, say which one it is, and migrate it if asked."""
    settings = settings_from(args)
    with announced_database(settings) as db:
        if migrated:
            with (
                translate_errors("connecting"),
                command_connection(db.dsn) as conn,
            ):
                applied = migrate(conn, settings.schema)
            if applied:
                say(f"pgonce: applied migrations {', '.join(f'{v:04d}' for v in applied)}")
        yield settings, db


def require_migrated(dsn: str, schema: str) -> None:
    """Refuse a schema that ``pgonce migrate`` has not brought up to date.

    Operator commands never create pgonce's tables: a mistyped --schema or --dsn would otherwise
    get a fresh, empty schema and act on nothing.
    """
    with (
        translate_errors("connecting"),
        command_connection(dsn) as conn,
        answered_in_time(dsn, conn, ANSWER_TIMEOUT, "reading the schema version"),
    ):
        state = status(conn, schema)
    if state.current == 0:
        raise SchemaNotMigrated(
            f"schema {schema} holds no pgonce tables: check --schema and --dsn, or run "
            "`pgonce migrate` to create them"
        )
    if state.newer:
        # A rollback to this pgonce after a newer one migrated: it runs on the schema, as the
        # service does (health warns too); `pgonce migrate` would refuse, not help.
        say(
            f"pgonce: warning: schema {schema} is at version {state.current}, newer than the "
            f"latest this pgonce knows ({state.latest}): a newer pgonce migrated it"
        )
        return
    if not state.up_to_date:
        raise SchemaNotMigrated(
            f"schema {schema} is at version {state.current} of {state.latest}: run "
            "`pgonce migrate` first"
        )


def print_proof(
    rows: list[tuple[str, object, str]], *, seconds: float, items: int, ok: bool
) -> None:
    """The exactly-once proof as the demos print it: a table, a rate, and the verdict."""
    print()
    for label, value, note in rows:
        print(f"  {label:<20} {value!s:>6}   {note}".rstrip())
    print(f"\n  {items / seconds:,.0f} deliveries/s in {seconds:.2f} s")
    print(f"\nexactly once: {'yes' if ok else 'NO'}")


def takes_no_writes(conn: psycopg.Connection[Any]) -> bool:
    """Whether the node refuses writes: a standby (in recovery), or read-only by default
    (default_transaction_read_only, as a DSN's options, the role's or the database's settings
    give it)."""
    with translate_errors("reading whether the server takes writes"), conn.transaction():
        row = conn.execute("SELECT current_setting('transaction_read_only')").fetchone()
    return row is not None and row[0] == "on"
