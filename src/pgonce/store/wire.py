"""pgonce's own statements, several per round trip, straight through psycopg's libpq layer.

Measured on the key store's hot path, psycopg's Python work per statement (cursor, query
conversion, adapters, a wait on the event loop for each) cost more than the database did: about
40-100 µs of client CPU for each of BEGIN, claim, completion and COMMIT. Here a round trip is a
*batch*: its statements are queued in libpq's pipeline mode with their parameters already encoded,
flushed once, and their results read in one wait. pgonce's statements are prepared once per
connection (unless the connection has ``prepare_threshold = None``, as behind a transaction-mode
pooler), under names of their own that never meet psycopg's. BEGIN and COMMIT too: the server then
skips parsing them (its CPU per fresh key, median of five alternated runs at four connections: 196
µs against 209 when they were sent unnamed).

Behind a transaction-mode pooler (PgBouncer before 1.21, or with ``max_prepared_statements = 0``)
a server session serves many clients in turn, so a name prepared by one client is missing for
another's next transaction (26000) or already taken (42P05); unique names per client would not
help, since the server sessions themselves are shared. pgonce's statements then go *unnamed*:
when the connection has ``prepare_threshold = None``, when the key store is told
``pooler="pgbouncer-transaction"``, and, for the rest of the process, as soon as a batch meets
42P05 (or 26000 twice on one connection): see :func:`sessions_shared`. A name always stands for
the same SQL (it is the statement's digest), so a pooler can make a named statement fail but never
run another one.

Only pgonce's statements travel here; the caller's statements keep going through psycopg. A batch
runs only on a connection that psycopg is not using for anything else: it holds the connection's
lock, and it refuses a connection in psycopg's pipeline mode (the store falls back to psycopg
there). After a batch the connection is in the state psycopg expects: pipeline mode off, every
result read, the transaction status whatever the statements left.

One generator (:func:`exchange`) does the protocol work for both I/O styles; :func:`round_trip`
drives it with psycopg's own waiting, :func:`async_round_trip` with the event loop's reader
callbacks: without psycopg's per-wait timer, which cost more than the rest of the round trip, and
through a registration kept per connection (:class:`_Watch`), because making and removing one for
every wait cost a third of the client's work for a fresh key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import json.scanner
import logging
import os
import struct
import sys
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from hmac import compare_digest
from typing import Any

import psycopg
from psycopg import errors, pq
from psycopg._queries import (
    MAX_CACHED_STATEMENT_LENGTH,
    PostgresQuery,
    _query2pg_nocache,
)
from psycopg.abc import Buffer, Params, PQGen, QueryNoTemplate
from psycopg.abc import Transformer as AdaptTransformer
from psycopg.adapt import Transformer
from psycopg.pq.abc import PGconn, PGresult
from psycopg.waiting import Ready, Wait

from pgonce.core.frozen import refuse_changes
from pgonce.core.outcomes import ClaimRow, Replay, _str_pairs, stored_replay

log = logging.getLogger("pgonce.store")

TEXT, BINARY = 0, 1
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_INVALID_STATEMENT_NAME = "26000"
_DUPLICATE_STATEMENT = "42P05"
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_PIPELINE_ABORTED = pq.ExecStatus.PIPELINE_ABORTED
_PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC
_COPY_OUT = pq.ExecStatus.COPY_OUT
_COPY_IN = (pq.ExecStatus.COPY_IN, pq.ExecStatus.COPY_BOTH)
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_CONNECTION_OK = pq.ConnStatus.OK
_PIPELINE_OFF = pq.PipelineStatus.OFF
# Likewise the waits, looked up twice a round trip; exchange() yields these very members, so
# async_round_trip() tells a wait for the answers by identity rather than by IntEnum's comparison.
_WAIT_R, _WAIT_W, _WAIT_RW = Wait.R, Wait.W, Wait.RW
_READY_R, _READY_W = Ready.R, Ready.W
# (Module constants, not pq.ExecStatus.X at each use: an enum class's attribute costs a thousand
# client instructions to look up, and these are read several times a round trip.)
# At most this many statements prepared per connection (a caller's queued writes included); more
# are sent unnamed, so that a stream of distinct queries cannot grow a session without bound.
MAX_PREPARED = 100

Param = Buffer | None


@refuse_changes
@dataclass(frozen=True, slots=True)
class Statement:
    """One of pgonce's statements, with ``$n`` placeholders and the format of each parameter."""

    sql: bytes
    formats: tuple[int, ...] = ()
    #: Parameter type OIDs; empty lets the server infer them from the statement.
    types: tuple[int, ...] = ()
    #: False: always sent unnamed. For a statement that must not fail on a prepared name inside
    #: the caller's transaction, where a failed statement would abort all of it (the savepoint
    #: that once() sets there before anything else).
    prepare: bool = True
    name: bytes = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(self.sql + repr(self.types).encode()).hexdigest()[:16]
        object.__setattr__(self, "name", f"_pgonce_{digest}".encode())


#: A statement with its encoded parameters (``()`` for one without, such as BEGIN and COMMIT).
#: A plain tuple: a batch builds several per round trip, and a frozen dataclass's ``__init__``
#: costs a microsecond per field.
Command = tuple[Statement, Sequence[Param]]
NO_PARAMS: Sequence[Param] = ()


class _Session:
    """What pgonce keeps per connection: the statements it prepared there, and its watch.

    Weakly keyed by the connection's ``PGconn``: a closed connection's entry goes with it.
    psycopg's own DEALLOCATE ALL is followed (:func:`_follow_deallocations`); one psycopg does not
    see (the application's, while psycopg holds no names) is detected by its error (26000) and
    answered by forgetting the prepared names.
    """

    __slots__ = ("prepared", "vanished", "watch")

    def __init__(self) -> None:
        self.prepared: set[bytes] = set()
        #: A statement prepared here went missing once (26000): a second time means the
        #: server session changes under the connection (a pooler), not a DEALLOCATE ALL.
        self.vanished = False
        self.watch: _Watch | None = None


class _Naming:
    """Whether pgonce's statements go unnamed in this whole process, and whether a name was
    found taken by another client (42P05): then the server's sessions are certainly shared."""

    __slots__ = ("crossed", "unnamed")

    def __init__(self) -> None:
        self.unnamed = False
        self.crossed = False


_naming = _Naming()


def statements_unnamed() -> bool:
    """Whether pgonce sends its statements unnamed on every connection of this process."""
    return _naming.unnamed


def statements_crossed() -> bool:
    """Whether a prepared statement's name was found taken by another client on the same server
    session (42P05): a connection that lets psycopg prepare its own statements there runs
    other clients' statements under their names."""
    return _naming.crossed


def sessions_shared(reason: str | None, *, warn_threshold: bool = False) -> None:
    """From now on, send pgonce's statements unnamed on every connection of this process.

    Called when a batch met a pooler's shared server sessions, and by the service when its
    configuration or its check at start says there is one (``reason`` None: the service logs
    its own line). Logs one line, the first time only: it says what was seen and, with
    ``warn_threshold`` (the connection still lets psycopg prepare statements), what the
    application must change.
    """
    if _naming.unnamed:
        return
    _naming.unnamed = True
    if reason is None:
        return
    advice = (
        " psycopg's own prepared statements are crossed between clients there too: connect with "
        'prepare_threshold=None (or set pooler = "pgbouncer-transaction", PGONCE_POOLER).'
        if warn_threshold
        else ""
    )
    log.warning(
        "%s: the server's sessions are shared between connections (a transaction-mode pooler); "
        "pgonce sends its statements unnamed from now on.%s",
        reason,
        advice,
    )


def _reset_naming() -> None:
    """Back to named statements (tests: one process runs with and without a pooler)."""
    _naming.unnamed = False
    _naming.crossed = False


class _Sessions:
    """The sessions by connection (``PGconn``), each dropped when its connection goes.

    A dict keyed by the connection's ``id()``, the entry removed by a finalizer of the
    connection: the id cannot be taken by another object before that finalizer has run. A
    ``WeakKeyDictionary`` did the same with a Python call and a new weak reference at every
    lookup, two per batch.
    """

    __slots__ = ("by_id",)

    def __init__(self) -> None:
        self.by_id: dict[int, _Session] = {}

    def get(self, pgconn: PGconn) -> _Session | None:
        return self.by_id.get(id(pgconn))

    def __getitem__(self, pgconn: PGconn) -> _Session:
        return self.by_id[id(pgconn)]

    def add(self, pgconn: PGconn) -> _Session:
        key = id(pgconn)
        session = self.by_id[key] = _Session()
        weakref.finalize(pgconn, self.by_id.pop, key, None)
        return session


_sessions = _Sessions()
_by_id = _sessions.by_id


def begin_statement(conn: psycopg.BaseConnection[Any]) -> Statement:
    """The BEGIN that psycopg would send for this connection's transaction settings."""
    if _PLAIN.get(type(conn)) or _plain(type(conn)):
        # psycopg's own properties, which return these attributes: three Python calls fewer
        # for every transaction the store opens.
        if conn._isolation_level is None and conn._read_only is None and conn._deferrable is None:
            return _PLAIN_BEGIN  # the default settings: no tuple made, hashed and looked up
        settings = (conn._isolation_level, conn._read_only, conn._deferrable)
    else:
        settings = (conn.isolation_level, conn.read_only, conn.deferrable)
    statement = _BEGINS.get(settings)
    if statement is None:
        isolation, read_only, deferrable = settings
        parts = [b"BEGIN"]
        if isolation is not None:
            parts += [b"ISOLATION LEVEL", isolation.name.replace("_", " ").encode()]
        if read_only is not None:
            parts.append(b"READ ONLY" if read_only else b"READ WRITE")
        if deferrable is not None:
            parts.append(b"DEFERRABLE" if deferrable else b"NOT DEFERRABLE")
        statement = _BEGINS[settings] = _simple(b" ".join(parts))
    return statement


# BEGIN by (isolation level, read only, deferrable): at most 5 x 3 x 3 entries.
_BEGINS: dict[tuple[Any, bool | None, bool | None], Statement] = {}


def _plain(cls: type) -> bool:
    """Whether a connection class reads its transaction settings and ``prepare_threshold``
    through psycopg's own properties (not overridden by a subclass): their attributes can then
    be read directly. Known per class after its first connection."""
    plain = _PLAIN.get(cls)
    if plain is None:
        base = psycopg.BaseConnection
        plain = _PLAIN[cls] = all(
            getattr(cls, name, None) is base.__dict__[name]
            for name in ("isolation_level", "read_only", "deferrable", "prepare_threshold")
        )
    return plain


_PLAIN: dict[type, bool] = {}


def encoding(conn: psycopg.BaseConnection[Any]) -> str:
    """The Python encoding of the text pgonce sends and reads on ``conn``: the connection's, as
    psycopg keeps it (``conn.info`` builds an object), except for ``SQL_ASCII``, where psycopg
    writes str as UTF-8 (its ``str`` dumpers do) and the server passes bytes through as they
    are: a key sent there must be the same bytes as psycopg's, and a stored response's headers
    come back as the database holds them."""
    name: str = conn.pgconn._encoding  # conn_encoding(conn), without its call
    return name if name != "ascii" else "utf-8"


_SIMPLE: dict[bytes, Statement] = {}


def _simple(sql: bytes) -> Statement:
    statement = _SIMPLE.get(sql)
    if statement is None:
        statement = _SIMPLE[sql] = Statement(sql)
    return statement


COMMIT = _simple(b"COMMIT")
#: What begin_statement() gives a connection with psycopg's default transaction settings.
_PLAIN_BEGIN = _simple(b"BEGIN")
ROLLBACK = _simple(b"ROLLBACK")

# once()'s savepoint in the caller's transaction, never prepared: the SAVEPOINT runs before
# anything that could fail on a name, and what undoes it must run whatever happened to names.
SAVEPOINT = Statement(b"SAVEPOINT pgonce_once", prepare=False)
RELEASE = Statement(b"RELEASE SAVEPOINT pgonce_once", prepare=False)
ROLLBACK_TO = Statement(b"ROLLBACK TO SAVEPOINT pgonce_once", prepare=False)


def usable(conn: psycopg.BaseConnection[Any]) -> bool:
    """Whether a batch may run here: the connection is open and not in psycopg's pipeline."""
    pgconn = conn.pgconn
    return pgconn.status == _CONNECTION_OK and pgconn.pipeline_status == _PIPELINE_OFF


def _queue(
    conn: psycopg.BaseConnection[Any],
    session: _Session,
    commands: Iterable[Command],
    named: bool,
    always: bool = False,
) -> tuple[int, list[tuple[int, bytes]]]:
    """Queue the commands in pipeline mode and send them with a sync.

    Statements are named (prepared once) only when ``named``, the connection lets psycopg
    prepare (or ``always``: the caller knows there is no pooler, whatever the connection's
    ``prepare_threshold`` says), and no pooler was met in this process.

    Returns how many results will come, and which of them answer a statement's preparation
    (their position and the name). A preparation is recorded only once it succeeded
    (:func:`_settle`): an earlier failure in the batch makes the server skip it.
    """
    pgconn = conn.pgconn
    prepared: set[bytes] | None = None
    if (
        named
        and not _naming.unnamed
        and (
            always
            # conn.prepare_threshold, without its property's call where it is psycopg's own.
            or (
                conn._prepared.prepare_threshold
                if _PLAIN.get(type(conn)) or _plain(type(conn))
                else conn.prepare_threshold
            )
            is not None
        )
    ):
        prepared = session.prepared
    preparing: list[tuple[int, bytes]] = []
    count = 0
    send_prepared = pgconn.send_query_prepared
    name: bytes | None
    pgconn.enter_pipeline_mode()
    for statement, params in commands:
        if prepared is not None and statement.prepare and (held := statement.name) in prepared:
            # The common case: a statement this connection holds prepared.
            send_prepared(held, params, param_formats=statement.formats, result_format=BINARY)
            count += 1
            continue
        name = None
        if prepared is not None and statement.prepare:
            name = statement.name
            # Not prepared on this connection yet, nor earlier in this batch: prepare it now,
            # or send it unnamed once the connection holds as many as it may.
            if name not in prepared and all(n != name for _, n in preparing):
                if len(prepared) + len(preparing) < MAX_PREPARED:
                    pgconn.send_prepare(name, statement.sql, statement.types or None)
                    preparing.append((count, name))
                    count += 1
                else:
                    name = None
        if name is None:
            pgconn.send_query_params(
                statement.sql,
                params,
                param_types=statement.types or None,
                param_formats=statement.formats,
                result_format=BINARY,
            )
        else:
            pgconn.send_query_prepared(
                name, params, param_formats=statement.formats, result_format=BINARY
            )
        count += 1
    pgconn.pipeline_sync()
    return count, preparing


def _settle(
    session: _Session, preparing: list[tuple[int, bytes]], results: list[PGresult]
) -> list[PGresult]:
    """Record the preparations that succeeded; return one result per command.

    A preparation that failed (a statement timeout, a name taken behind pgonce's back) answers
    for its command: the command itself was skipped (``PIPELINE_ABORTED``, no rows), and read as
    an answer it would say "no row" -- for the claim, "did not win".
    """
    if not preparing:
        return results
    settled = list(results)
    made: list[bytes] = []
    for index, name in preparing:
        if results[index].status == _COMMAND_OK:
            session.prepared.add(name)
            made.append(name)
        else:
            settled[index + 1] = results[index]
    skip = {index for index, _ in preparing}
    answers = _Settled(result for index, result in enumerate(settled) if index not in skip)
    answers.made = made
    return answers


class _Settled(list[PGresult]):
    """A batch's results, when it prepared statements: ``made`` names those it prepared.

    They exist on the server whatever else the batch met. A later statement of the same batch
    that fails on a name deallocated behind pgonce's back (26000) must not make them forgotten
    too: their next preparation would fail on the name (42P05), which means a pooler that
    shares sessions.
    """

    __slots__ = ("made",)
    made: list[bytes]


def exchange(pgconn: PGconn, expected: int) -> PQGen[list[PGresult]]:
    """Flush what is queued, read ``expected`` results and the sync, and leave pipeline mode.

    Each statement answers with one result (``PIPELINE_ABORTED`` for those skipped after an
    error) followed by libpq's end-of-statement marker (``None``), then the sync's result. A
    connection lost halfway (the server restarted, the network cut) answers with fewer: that is
    raised as :class:`psycopg.OperationalError`. Notifications that arrive meanwhile go to the
    connection's handlers, as psycopg's own fetch would pass them on.

    libpq is asked for input only after a wait said the socket is readable: a read attempted
    before the answer came would be a system call for nothing. It is asked whether it is busy
    only where the next result may need input: not for the end marker that follows a result,
    which ``PQgetResult`` returns without reading (the result's command is over; it blocks
    only while a command waits for data not read yet). Each ask is a call into libpq that
    releases and takes back the GIL, and a statement was asked about twice.

    A result followed by another instead of the end marker is a COPY (a caller's queued write):
    libpq answers a COPY with its result again at every call, for as long as the COPY lasts.
    ``COPY ... TO STDOUT`` runs on the server without the client, and the statements after it
    (COMMIT too) with it: its data is read and dropped, as a SELECT's rows are, and its final
    result answers for it, so that what the batch reports is what the server did. A batch
    cannot feed ``COPY ... FROM STDIN``: that is raised as :class:`psycopg.ProgrammingError`
    with the COPY still open, and the connection cannot go on (see :func:`_abandon`); the server
    runs nothing after it.
    """
    while pgconn.flush():
        ready = yield _WAIT_RW
        if ready & _READY_R:
            pgconn.consume_input()
    results: list[PGresult] = []
    while True:
        while pgconn.is_busy():
            yield _WAIT_R
            try:
                pgconn.consume_input()
            except psycopg.OperationalError:
                raise _lost(pgconn, results) from None
            while notify := pgconn.notifies():
                if pgconn.notify_handler:
                    pgconn.notify_handler(notify)
        result = pgconn.get_result()
        if result is None:
            raise _lost(pgconn, results)  # nothing more will come
        if result.status == _PIPELINE_SYNC:
            if len(results) != expected:
                raise _lost(pgconn, results)
            pgconn.exit_pipeline_mode()
            return results
        results.append(result)
        if pgconn.get_result() is not None:  # the end marker, read without input (see above)
            if result.status != _COPY_OUT:
                # Only a COPY answers twice; anything else is a protocol out of step.
                raise _copy(result) if result.status in _COPY_IN else _lost(pgconn, results)
            results[-1] = yield from _copied_out(pgconn, results)
            if pgconn.get_result() is not None:
                raise _lost(pgconn, results)


def _copied_out(pgconn: PGconn, results: list[PGresult]) -> PQGen[PGresult]:
    """Read a ``COPY ... TO STDOUT`` to its end, dropping its data; its final result."""
    while True:
        try:
            nbytes = pgconn.get_copy_data(1)[0]
        except psycopg.OperationalError:
            raise _lost(pgconn, results) from None
        if nbytes == -1:
            break
        if nbytes == 0:
            yield _WAIT_R
            try:
                pgconn.consume_input()
            except psycopg.OperationalError:
                raise _lost(pgconn, results) from None
    # Its end read, the final result may still be on its way: PQgetResult would wait for it in
    # the caller's thread (the event loop's).
    while pgconn.is_busy():
        yield _WAIT_R
        try:
            pgconn.consume_input()
        except psycopg.OperationalError:
            raise _lost(pgconn, results) from None
    result = pgconn.get_result()
    if result is None:
        raise _lost(pgconn, results)
    return result


def _copy(result: PGresult) -> psycopg.ProgrammingError:
    """The error for a statement that answered with a COPY a batch cannot run."""
    status = pq.ExecStatus(result.status).name
    return psycopg.ProgrammingError(
        f"a statement of pgonce's batch answered {status}: COPY FROM STDIN cannot run among "
        "the writes that op.execute() or commit(writes=...) queue; run it on the connection "
        "with cursor.copy() before the block ends"
    )


def _lost(pgconn: PGconn, results: list[PGresult]) -> psycopg.OperationalError:
    """The error for a batch whose answers stopped coming: the server's last words if any."""
    said = [r.error_message for r in results if r.status == pq.ExecStatus.FATAL_ERROR]
    message = said[-1] if said else pgconn.error_message
    text = message.decode("utf-8", "replace").strip() or "the connection was lost"
    return psycopg.OperationalError(text)


def failure(
    conn: psycopg.BaseConnection[Any], results: Sequence[PGresult]
) -> tuple[int, psycopg.Error] | None:
    """The first failed command of a batch: its index and its error; None when all succeeded.

    A command the server skipped (``PIPELINE_ABORTED``) without an error before it is a failure
    too: its result has no rows, which must never be read as an answer.
    """
    # Once a command of a pipeline fails, the server skips every later one up to the sync: a
    # batch whose last command neither failed nor was skipped succeeded whole, and the common
    # case reads one status instead of walking them all.
    if results and (last := results[-1].status) != _FATAL_ERROR and last != _PIPELINE_ABORTED:
        return None
    aborted = -1
    for index, result in enumerate(results):
        status = result.status
        if status == _FATAL_ERROR:
            error = errors.error_from_result(result, encoding=conn.info.encoding)
            if error.sqlstate in (_INVALID_STATEMENT_NAME, _DUPLICATE_STATEMENT):
                _naming_failed(conn, error, getattr(results, "made", ()))
            return index, error
        if status == _PIPELINE_ABORTED and aborted < 0:
            aborted = index
    if aborted >= 0:
        return aborted, errors.PipelineAborted("the server skipped a statement of the batch")
    return None


def _naming_failed(
    conn: psycopg.BaseConnection[Any], error: psycopg.Error, made: Iterable[bytes] = ()
) -> None:
    """A named statement failed: forget what this connection prepared, and tell a pooler.

    42P05 means another client prepared the name on this server session: sessions are shared.
    26000 is also what DEALLOCATE ALL or DISCARD ALL leave behind, on a direct connection too;
    only its second time on one connection counts as a pooler. What the failed batch itself
    prepared (``made``) was prepared after that: it stays known.
    """
    session = _sessions.get(conn.pgconn)
    vanished_before = session is not None and session.vanished
    if error.sqlstate == _DUPLICATE_STATEMENT:
        _naming.crossed = True
    if session is not None:
        session.prepared.clear()
        session.vanished = True
        if error.sqlstate == _INVALID_STATEMENT_NAME:
            session.prepared.update(made)
    if error.sqlstate == _DUPLICATE_STATEMENT or vanished_before:
        sessions_shared(
            f"a prepared statement of pgonce's failed ({error.sqlstate}: "
            f"{str(error).strip().splitlines()[0]})",
            warn_threshold=conn.prepare_threshold is not None,
        )


def names_failed(conn: psycopg.BaseConnection[Any], error: BaseException | None) -> bool:
    """Whether ``error`` is a prepared statement's name failing (26000, 42P05) on a statement
    that psycopg sent for pgonce (in psycopg's pipeline, or the sweeper's); if so, it counts as
    a batch's would (see :func:`_naming_failed`): 42P05 is another client's name on the same
    server session, a second 26000 on one connection a pooler. For error paths only.
    """
    if not isinstance(error, psycopg.Error) or error.sqlstate not in (
        _INVALID_STATEMENT_NAME,
        _DUPLICATE_STATEMENT,
    ):
        return False
    if _sessions.get(conn.pgconn) is None:
        _follow_deallocations(conn, _sessions.add(conn.pgconn))
    _naming_failed(conn, error)
    return True


def stale_plan(
    conn: psycopg.BaseConnection[Any], statement: Statement, error: BaseException
) -> Command | None:
    """The command that deallocates ``statement`` after ``error``, when the error says that its
    prepared plan no longer fits the tables (0A000: its result type changed, after an ALTER
    TABLE of another connection); None otherwise. The name is forgotten here, so that the next
    batch prepares the statement again. psycopg names its own statements apart: they are not
    touched.
    """
    if not isinstance(error, errors.FeatureNotSupported) or _STALE_PLAN not in str(error):
        return None
    session = _sessions.get(conn.pgconn)
    if session is None or statement.name not in session.prepared:
        return None
    session.prepared.discard(statement.name)
    return Statement(b"DEALLOCATE " + statement.name, prepare=False), NO_PARAMS


_STALE_PLAN = "cached plan must not change result type"


def round_trip(
    conn: psycopg.Connection[Any],
    commands: Sequence[Command],
    *,
    named: bool = True,
    always: bool = False,
) -> list[PGresult]:
    """Run ``commands`` in one round trip; return one result per command (see :func:`failure`).

    ``named`` false sends every statement unnamed; ``always`` names them on a connection whose
    ``prepare_threshold`` is None too (see :func:`_queue`).
    """
    with conn.lock:
        # _begin_batch(), its common case written out (as async_round_trip() has it).
        pgconn = conn.pgconn
        if (
            pgconn.status != _CONNECTION_OK
            or pgconn.pipeline_status != _PIPELINE_OFF
            or (session := _by_id.get(id(pgconn))) is None
        ):
            session = _begin_batch(conn)
        try:
            count, preparing = _queue(conn, session, commands, named, always)
            results = conn.wait(exchange(pgconn, count))
        except BaseException:
            _abandon(conn, session)
            raise
    return _settle(session, preparing, results) if preparing else results


async def async_round_trip(
    conn: psycopg.AsyncConnection[Any],
    commands: Sequence[Command],
    *,
    named: bool = True,
    always: bool = False,
) -> list[PGresult]:
    """Run ``commands`` in one round trip; return one result per command (see :func:`failure`).

    ``named`` false sends every statement unnamed; ``always`` names them on a connection whose
    ``prepare_threshold`` is None too (see :func:`_queue`).
    """
    # acquire() and release() rather than ``async with``: the lock's __aenter__ and __aexit__
    # are two more coroutines per round trip around the same calls. And for psycopg's own lock
    # (an asyncio.Lock), their common case written out (see _LOCK): three Python calls fewer
    # per round trip, a coroutine among them.
    lock: Any = conn.lock  # Any: typeshed does not declare _locked
    if type(lock) is _LOCK and not lock._locked and not lock._waiters:
        lock._locked = True  # acquire() of a free lock that nobody waits for
    else:
        await lock.acquire()
    try:
        # _begin_batch(), its common case written out.
        pgconn = conn.pgconn
        if (
            pgconn.status != _CONNECTION_OK
            or pgconn.pipeline_status != _PIPELINE_OFF
            or (session := _by_id.get(id(pgconn))) is None
        ):
            session = _begin_batch(conn)
        try:
            count, preparing = _queue(conn, session, commands, named, always)
            # The libpq generator on the event loop: one callback per wait, no timer. Here rather
            # than in a coroutine of its own, which was one more to make and to resume at each
            # wait. A wait for the answers (the common one) goes through the connection's
            # _Watch; a wait to send (a batch larger than the socket's buffer) registers for
            # itself (_wait_alone()).
            gen = exchange(pgconn, count)
            loop = asyncio.get_running_loop()
            try:
                wait = next(gen)
                while True:
                    future: asyncio.Future[Ready] = loop.create_future()
                    watch = session.watch
                    if wait is _WAIT_R and (
                        # _watch(), its common case written out: the connection's watch, on
                        # this loop.
                        (watch is not None and watch.source == pgconn.socket and watch.loop is loop)
                        or (watch := _watch(pgconn, session, loop)) is not None
                    ):
                        if watch.registered:  # watch.wait(), its common case written out
                            watch.waiter = future
                            watch.strikes = 0
                        else:
                            watch.wait(future)
                        try:
                            ready = await future
                        finally:
                            watch.waiter = None
                    else:
                        ready = await _wait_alone(loop, pgconn.socket, wait, future)
                    wait = gen.send(ready)
            except StopIteration as done:
                results: list[PGresult] = done.value
            except OSError as error:
                raise psycopg.OperationalError("connection socket closed") from error
        except BaseException:
            _abandon(conn, session)
            raise
    finally:
        if type(lock) is _LOCK and lock._locked and not lock._waiters:
            lock._locked = False  # release() with no waiter to wake
        else:
            lock.release()
    return _settle(session, preparing, results) if preparing else results


def _lock_written_out() -> type[asyncio.Lock] | None:
    """asyncio.Lock, if its state is what async_round_trip() reads and writes for its common
    case: ``_locked``, and ``_waiters`` (None or a deque of the waiting futures). In that case
    acquire() only sets ``_locked`` (a free lock nobody waits for), and release() only clears it
    (a held lock nobody waits for), from Python 3.11 to 3.13 at least. None (always through
    acquire() and release()) where a fresh lock does not look so."""
    fresh = asyncio.Lock()
    if getattr(fresh, "_locked", None) is False and getattr(fresh, "_waiters", 0) is None:
        return asyncio.Lock
    return None


_LOCK: Any = _lock_written_out()  # Any: typeshed does not declare what is read


def _begin_batch(conn: psycopg.BaseConnection[Any]) -> _Session:
    """The connection's session, once it is known to be able to run a batch."""
    pgconn = conn.pgconn
    if pgconn.status != _CONNECTION_OK:
        raise psycopg.OperationalError("the connection is closed")
    if pgconn.pipeline_status != _PIPELINE_OFF:
        raise psycopg.ProgrammingError("a pgonce batch cannot run inside psycopg's pipeline")
    session = _by_id.get(id(pgconn))
    if session is None:
        session = _sessions.add(pgconn)
        _follow_deallocations(conn, session)
    return session


def _follow_deallocations(conn: psycopg.BaseConnection[Any], session: _Session) -> None:
    """Forget the session's prepared names whenever psycopg deallocates its own.

    psycopg sends DEALLOCATE ALL after a ROLLBACK, DROP, ALTER or DISCARD ALL it runs while it
    holds prepared statements, and on ``rollback()`` while it holds any: each time after its
    prepare manager's ``clear()`` returned True; this wraps that method on this connection's
    manager only. pgonce's statements go with psycopg's, so the next batch prepares them again
    instead of failing on a name the server no longer has (26000) inside a transaction it
    cannot run again.
    """
    manager = getattr(conn, "_prepared", None)
    clear = getattr(manager, "clear", None)
    if clear is None:
        return
    prepared = session.prepared

    def cleared() -> bool:
        # rollback() calls clear() whether psycopg holds names or not: only True deallocates.
        deallocating = bool(clear())
        if deallocating:
            prepared.clear()
        return deallocating

    manager.clear = cleared  # type: ignore[union-attr]


def _abandon(conn: psycopg.BaseConnection[Any], session: _Session) -> None:
    """A round trip interrupted halfway leaves results unread: the connection cannot go on.

    Closing it is the one safe answer (the server rolls back its open transaction, and a pool
    discards a closed connection); otherwise the next user would read this batch's results.

    So is one that psycopg finished by itself: on KeyboardInterrupt or SystemExit its wait
    cancels the statement, reads the round trip to its end and raises, and the answers never
    reach pgonce. What the batch did is then unknown: a statement prepared under a name this
    session did not record (the next preparation would fail on it, 42P05, taken for a pooler
    that shares sessions), a savepoint released or not, which a rollback to its name could
    mistake for an outer block's.
    """
    if session.watch is not None:
        session.watch.close()
        session.watch = None
    conn.pgconn.finish()


async def _wait_alone(
    loop: asyncio.AbstractEventLoop, fileno: int, wait: Wait, future: asyncio.Future[Ready]
) -> Ready:
    """A batch's wait that does not go through the connection's watch (a wait to send: a batch
    larger than the socket's buffer), registered for itself and removed after."""
    if wait & _WAIT_W:
        loop.add_writer(fileno, _wake, future, _READY_W)
    if wait & _WAIT_R:
        loop.add_reader(fileno, _wake, future, _READY_R)
    try:
        return await future
    finally:
        if wait & _WAIT_W:
            loop.remove_writer(fileno)
        if wait & _WAIT_R:
            loop.remove_reader(fileno)


def _wake(future: asyncio.Future[Ready], ready: Ready) -> None:
    if not future.done():
        future.set_result(ready)


class _Watch:
    """The event loop's interest in a connection's answers, kept between round trips.

    Registering a descriptor with the event loop for one wait and removing it afterwards costs
    two ``epoll_ctl`` calls and, on uvloop, a poll handle made and closed: measured at 16
    connections, that was a third of the client's cost of a fresh key's round trips. So a batch
    waits for its answers through a registration that stays, on a duplicate of the connection's
    descriptor (``dup``), so that psycopg, which registers and removes the original descriptor
    for its own waits, never disturbs it.

    On asyncio's own selector loop, which keeps a registration until it is removed, the watch
    registers once and later waits only name their future: registering again there is no system
    call but still a handle made and an old one cancelled, about a tenth of a tight loop of
    fresh keys (py-spy). uvloop closes a registration whose socket reports an error, after
    calling the reader one last time, and drops its handle of the callback then: there the watch
    registers a callback that nothing else holds and keeps a weak reference to it, so that the
    registration is known to stand for as long as the callback lives, and the next wait after
    uvloop dropped it registers again. Registering again at every wait instead (no system call,
    but a handle made and one cancelled, and a failed lookup of uvloop's in Python) cost 5,700
    client instructions per wait, a tenth of a replay's batches. On any other loop each wait
    registers again, which renews the registration wherever the loop may drop it. The watch
    never reads. The socket turns readable while no batch waits when psycopg reads this
    connection for the caller's statements (the HTTP endpoint's, between the claim and the
    completion): twice in a row is tolerated (asyncio's loop reports it once more in the
    iteration in which psycopg reads the answer; with one, the watch stepped aside at every
    such statement and registered again at the next batch). A third time means nobody reads
    (the server closed an idle connection): the watch steps aside until the next batch, so a
    connection nobody reads never keeps the loop busy.
    """

    __slots__ = (
        "armed",
        "fd",
        "followed",
        "kept",
        "loop",
        "registered",
        "source",
        "strikes",
        "waiter",
    )

    def __init__(self, source: int, loop: asyncio.AbstractEventLoop) -> None:
        self.source = source
        self.fd = os.dup(source)
        self.loop = loop
        #: The loop keeps a registration until it is removed (asyncio's own selector loop).
        self.kept = isinstance(loop, asyncio.SelectorEventLoop)
        #: uvloop: the registration is kept for as long as the loop holds its callback.
        uv = sys.modules.get("uvloop")
        self.followed = not self.kept and uv is not None and isinstance(loop, uv.Loop)
        #: A weak reference to the callback of the followed registration.
        self.armed: weakref.ref[Any] | None = None
        #: Registered, and known to stay so: a wait need not register again.
        self.registered = False
        self.strikes = 0
        self.waiter: asyncio.Future[Ready] | None = None

    def wait(self, future: asyncio.Future[Ready]) -> None:
        self.waiter = future
        self.strikes = 0
        if self.registered:
            return
        # A new bound method for each registration: on uvloop the loop's handle holds the only
        # reference to it, so that it goes when the loop drops the registration (see _dropped).
        readable = self._readable
        try:
            self.loop.add_reader(self.fd, readable)
        except RuntimeError:
            # uvloop: the registration was closed after a socket error; make a new one.
            self.loop.remove_reader(self.fd)
            self.loop.add_reader(self.fd, readable)
        if self.kept:
            self.registered = True
        elif self.followed:
            self.armed = weakref.ref(readable, self._dropped)
            self.registered = True

    def _dropped(self, armed: weakref.ref[Any]) -> None:
        """uvloop let go of the callback of this registration: it was removed, or closed after a
        socket error (uvloop drops its handle then, having called it one last time). The next
        wait registers again."""
        if armed is self.armed:
            self.armed = None
            self.registered = False

    def _readable(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(_READY_R)
        elif self.strikes < _TOLERATED:
            self.strikes += 1
        else:
            self.loop.remove_reader(self.fd)
            self.registered = False

    def close(self) -> None:
        """Unregister and close the duplicate (in the loop's thread, or after the loop closed)."""
        if self.fd < 0:
            return
        if not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
        self.registered = False
        self.armed = None
        os.close(self.fd)
        self.fd = -1


#: Readiness reports in a row, with no batch waiting, that a watch lets pass (see _Watch).
_TOLERATED = 2


def _watch(pgconn: PGconn, session: _Session, loop: asyncio.AbstractEventLoop) -> _Watch | None:
    """The connection's watch on ``loop``; None where there can be none (another loop has it,
    or the descriptor cannot be duplicated): the wait then registers for itself."""
    watch = session.watch
    source = pgconn.socket
    if watch is not None and watch.source == source:
        return watch if watch.loop is loop else None
    if watch is not None:  # libpq reconnected on a new socket
        session.watch = None
        watch.close()
    try:
        watch = _Watch(source, loop)
    except OSError:
        return None
    session.watch = watch
    # Closed with the connection: the finalizer holds the watch, never the connection.
    weakref.finalize(pgconn, _close_watch, watch)
    return watch


def _close_watch(watch: _Watch) -> None:
    """The finalizer: a dropped connection's watch is closed in its loop's thread."""
    if not watch.loop.is_closed():
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            watch.loop.call_soon_threadsafe(watch.close)
            return
    watch.close()


def caller_command(
    conn: psycopg.BaseConnection[Any],
    query: QueryNoTemplate,
    params: Params | None,
    encoding: str | None = None,
) -> Command:
    """A caller's statement (psycopg placeholders and adapters) as a command of a batch.

    psycopg's own query conversion does the work, so placeholders, adapters and types are
    exactly what ``conn.execute()`` would send. It lives in a private module (``psycopg._queries``)
    that has kept this interface since psycopg 3.0; tests/keys/test_batches.py exercises it.

    A query given as ``str`` or ``bytes`` (the usual literal) is converted once per encoding:
    its ``$n`` form and placeholders are kept here (:class:`_Converted`), and each call only
    checks and dumps its parameters, as psycopg's conversion does after its own cache. That
    conversion (the query's encoding, psycopg's cache lookup, a helper object per call) was the
    largest single cost of a queued write: 26,000 client instructions of a fresh key's 267,000
    (``python -m bench.client_instructions``). Any other query (``sql.Composed``, a query
    longer than psycopg caches) goes through psycopg's conversion every time.

    ``encoding``: the connection's, as psycopg names it (``conn.pgconn._encoding``), when the
    caller has just read it: each read asks libpq for the parameter and maps its name.
    """
    # A new Transformer each time, as psycopg makes one per cursor: one kept per connection
    # would hold the connection (it references it), and keep it and its session from ever
    # being collected; it would also keep dumpers chosen before the caller registered others.
    transformer = Transformer.from_context(conn)
    if params is not None and type(query) in _CACHED_KINDS:
        # _converted()'s lookup first, with the transformer's encoding (conn_encoding(conn))
        # read from the connection: two Python calls fewer per queued write.
        if encoding is None:
            encoding = conn.pgconn._encoding
        converted = _CONVERTED.get((query, encoding))  # type: ignore[arg-type]
        if converted is None:
            converted = _converted(transformer, query)
        if converted is not None:
            # psycopg's check of the parameters against the placeholders, without its two calls
            # where it passes: a list or tuple for as many positional placeholders. Anything
            # else goes through psycopg's own check, which raises what conn.execute() would.
            if (
                converted.order is None
                and (type(params) is tuple or type(params) is list)
                and len(params) == converted.count
            ):
                values: Sequence[Any] = params
            else:
                values = PostgresQuery.validate_and_reorder_params(
                    converted.parts, params, converted.order
                )
            dumped = transformer.dump_sequence(values, converted.want_formats)
            shape = (transformer.types or (), tuple(transformer.formats or ()))
            statement = converted.statements.get(shape)
            if statement is None:
                if len(converted.statements) >= MAX_CALLER_STATEMENTS:
                    converted.statements.clear()
                statement = converted.statements[shape] = Statement(
                    converted.sql, shape[1], shape[0]
                )
            return statement, dumped
    full = PostgresQuery(transformer)
    full.convert(query, params)
    formats = tuple(full.formats or ())
    return _caller_statement(full.query, formats, full.types), full.params or ()


@dataclass(slots=True)
class _Converted:
    """A caller's query as psycopg converts it, before any parameter: what each call reuses."""

    sql: bytes
    want_formats: list[Any]
    order: list[str] | None
    parts: list[Any]
    #: The query's placeholders.
    count: int
    #: The statement by the parameters' (types, formats), which the dumpers decide per call.
    statements: dict[tuple[tuple[int, ...], tuple[int, ...]], Statement] = field(
        default_factory=dict
    )


def _converted(transformer: AdaptTransformer, query: QueryNoTemplate) -> _Converted | None:
    """psycopg's conversion of a str or bytes ``query``, made once per encoding; None for a query
    longer than psycopg would cache (converted anew at every call, as psycopg does)."""
    encoding = transformer.encoding
    key = (query, encoding)
    converted = _CONVERTED.get(key)  # type: ignore[arg-type]
    if converted is not None:
        return converted
    raw = query.encode(encoding) if isinstance(query, str) else query
    if not isinstance(raw, bytes) or len(raw) > MAX_CACHED_LENGTH:
        return None
    sql, want_formats, order, parts = _query2pg_nocache(raw, encoding)
    if len(_CONVERTED) >= MAX_CALLER_STATEMENTS:
        _CONVERTED.clear()
    converted = _Converted(sql, want_formats, order, parts, len(parts) - 1)
    _CONVERTED[key] = converted  # type: ignore[index]
    return converted


def _caller_statement(sql: bytes, formats: tuple[int, ...], types: tuple[int, ...]) -> Statement:
    shape = (sql, formats, types)
    statement = _CALLERS.get(shape)
    if statement is None:
        if len(_CALLERS) >= MAX_CALLER_STATEMENTS:
            _CALLERS.clear()
        statement = _CALLERS[shape] = Statement(*shape)
    return statement


# The caller's statements seen so far, so that a statement's name is hashed once, not per call:
# by the query as the caller wrote it (str or bytes, with its encoding), and by the converted
# query for the others.
_CONVERTED: dict[tuple[str | bytes, str], _Converted] = {}
# Exactly these types: a subclass may compare or hash otherwise.
_CACHED_KINDS = (str, bytes)
_CALLERS: dict[tuple[bytes, tuple[int, ...], tuple[int, ...]], Statement] = {}
MAX_CALLER_STATEMENTS = 1000
# psycopg's own limit for its conversion cache: a longer query is converted anew at every call.
MAX_CACHED_LENGTH = MAX_CACHED_STATEMENT_LENGTH


# Parameter encoding: pgonce's own parameters are few and of known types.


def number(value: int | None) -> Param:
    return None if value is None else b"%d" % value


def timestamp(value: datetime | None) -> Param:
    return None if value is None else value.isoformat().encode()


# One encoder: json.dumps() with separators builds a new one per call.
_JSON = json.JSONEncoder(separators=(",", ":"))


def json_text(value: Any) -> bytes:
    return _JSON.encode(value).encode()


def headers_json(headers: Iterable[tuple[str, str]]) -> bytes:
    """Response headers as the stored JSON array of ``[name, value]`` pairs.

    What ``json.dumps`` writes (compact, ASCII), built from its own string quoting: the
    encoder's general path costs more than the few pairs of a response.

    A tuple of them (what a :class:`~pgonce.Response` holds) is encoded once and then found by
    value: an application answers with few distinct sets of headers, and the lookup costs a
    fifth of the encoding.
    """
    last = _last_headers[0]  # one read: another thread may replace it
    if headers is last[0]:  # the same tuple as the last response's: its encoding
        return last[1]
    if type(headers) is tuple:
        try:
            known = _HEADERS_JSON.get(headers)
        except TypeError:  # an unhashable member: encoded below, and not kept
            known = None
            headers = list(headers)
        if known is not None:
            _last_headers[0] = (headers, known)
            return known
    try:
        pairs = ",".join([f"[{_quote(name)},{_quote(value)}]" for name, value in headers])
    except TypeError:  # not str pairs: let the encoder say what it makes of them
        return json_text([list(pair) for pair in headers])
    encoded = f"[{pairs}]".encode()
    # Kept only for a tuple of str pairs, which cannot change. Each pair unpacked into two
    # above, so its members are those two. A plain loop: sets of the types collected in C cost
    # twice as much for a response's few pairs, and this runs for every new set of headers (a
    # Location naming the new resource makes every response's new).
    if type(headers) is not tuple:
        return encoded
    for pair in headers:
        if type(pair) is not tuple or type(pair[0]) is not str or type(pair[1]) is not str:
            return encoded
    if len(_HEADERS_JSON) >= MAX_HEADER_SETS:
        _HEADERS_JSON.clear()
    _HEADERS_JSON[headers] = encoded
    return encoded


#: The last tuple of headers found in _HEADERS_JSON (only such tuples: of str pairs, which
#: cannot change), and its encoding.
_last_headers: list[tuple[Any, bytes]] = [((), b"[]")]
#: The encoded headers by the tuple of pairs they encode; at most MAX_HEADER_SETS, then anew.
_HEADERS_JSON: dict[tuple[tuple[str, str], ...], bytes] = {}
MAX_HEADER_SETS = 256


_quote = json.encoder.encode_basestring_ascii


# Result decoding (binary format) of begin()'s claim: claim_insert's row (claimed_at, restored)
# when it won, else claim_read's: fingerprint, claimed_at, completed_at, response_status,
# response_headers (jsonb), response_body.


def claimed_at(inserted: PGresult) -> datetime:
    """The claim time a won claim's INSERT returned."""
    value = _time(inserted.get_value(0, 0))
    assert value is not None
    return value


def claimed(inserted: PGresult) -> tuple[datetime, bytes | None, bytes | None]:
    """:func:`claimed_at` and :func:`row` in one call (begin()'s won claim reads them all)."""
    value = inserted.get_value
    stamp = value(0, 0)
    assert stamp is not None  # claimed_at NOT NULL
    microseconds: int = _INT64(stamp)[0]
    return _EPOCH + _MICROSECOND * microseconds, value(0, 2), value(0, 3)


def row(inserted: PGresult) -> tuple[bytes | None, bytes | None]:
    """Where a won claim's INSERT put its row (its ctid) and the id of the transaction it was
    made in, as PostgreSQL sends them in binary."""
    value = inserted.get_value
    return value(0, 2), value(0, 3)


def stored_row(stored: PGresult, encoding: str) -> ClaimRow:
    """The facts of a claim whose INSERT did nothing, from its read of the stored row.

    ``encoding`` is the connection's.
    """
    assert stored.ntuples == 1, "claim_read returned no row"
    value = stored.get_value
    fingerprint = value(0, 0)
    if fingerprint is None:
        # The row the INSERT conflicted with went before the read (the sweeper, or by hand).
        return ClaimRow("gone", None, None, None, None, None, None)
    # claimed_at is NOT NULL; the rest may be. The decoders written out (_time, _int, _bytes):
    # this runs for every replay.
    completed_at, status, headers, body = value(0, 2), value(0, 3), value(0, 4), value(0, 5)
    return ClaimRow(
        "existing",
        fingerprint if type(fingerprint) is bytes else bytes(fingerprint),
        _time(value(0, 1)),
        None if completed_at is None else _EPOCH + _MICROSECOND * _INT64(completed_at)[0],
        None if status is None else int.from_bytes(status, "big", signed=True),
        None if headers is None else _stored_headers(headers, encoding),
        body if body is None or type(body) is bytes else bytes(body),
    )


def replayed(stored: PGresult, encoding: str, fingerprint: bytes) -> Replay | None:
    """The :class:`~pgonce.core.outcomes.Replay` that ``decide(stored_row(stored, encoding))``
    answers, for its common case only: a completed row of the same ``fingerprint``, read on a
    UTF-8 connection, whose headers were met before (:data:`_REPLAYABLE`). None for anything
    else, a mismatch included: decide() answers it, with every check.

    It makes no :class:`ClaimRow` and runs none of Response's checks of the headers again: this
    runs for every replay.
    """
    if encoding != "utf-8" or stored.ntuples != 1:
        return None
    value = stored.get_value
    headers = value(0, 4)
    if headers is None or (known := _REPLAYABLE.get(headers)) is None:
        return None
    stored_fingerprint, completed_at = value(0, 0), value(0, 2)
    if (
        type(stored_fingerprint) is not bytes
        or completed_at is None
        or not compare_digest(stored_fingerprint, fingerprint)
    ):
        return None
    status, body, claimed = value(0, 3), value(0, 5), value(0, 1)
    if type(body) is not bytes or claimed is None:
        return None
    claimed_at = _EPOCH + _MICROSECOND * _INT64(claimed)[0]
    return stored_replay(
        None if status is None else int.from_bytes(status, "big", signed=True),
        known,
        body,
        claimed_at,
        # begin() and once() make a row born completed at its claim time and keep that time
        # at the completion: the same bytes, decoded once (a datetime is immutable).
        claimed_at if completed_at == claimed else _EPOCH + _MICROSECOND * _INT64(completed_at)[0],
    )


def _stored_headers(stored: bytes, encoding: str) -> Any:
    """A stored response's headers (jsonb in binary: a version byte, then the text).

    As ``(name, value)`` tuples of str when they are such pairs, which a replay's
    :class:`~pgonce.Response` then takes as they are; anything else as parsed. An application
    stores few distinct sets of headers, so a UTF-8 connection's are parsed once and then found
    by their bytes (at most MAX_HEADER_SETS of them): a dict lookup rather than a decode, a
    parse and a list per pair for every replay.
    """
    if encoding != "utf-8":
        return _header_pairs(json_value(bytes(stored)[1:].decode(encoding)))
    known = _STORED_HEADERS.get(stored)
    if known is not None:
        return known
    stored = bytes(stored)
    headers = _header_pairs(json_value(stored[1:].decode(encoding)))
    if type(headers) is tuple:
        if len(_STORED_HEADERS) >= MAX_HEADER_SETS:
            _STORED_HEADERS.clear()
            _REPLAYABLE.clear()
        _STORED_HEADERS[stored] = headers
        if _str_pairs(headers):
            _REPLAYABLE[stored] = headers
    return headers


def _header_pairs(value: Any) -> Any:
    """``value`` as a tuple of ``(name, value)`` str tuples if it is a list of such pairs."""
    if type(value) is not list:
        return value
    for pair in value:
        if type(pair) is not list or len(pair) != 2:
            return value
        name, text = pair
        if type(name) is not str or type(text) is not str:
            return value
    return tuple([(name, text) for name, text in value])


#: The stored headers of UTF-8 connections by their bytes, as _stored_headers gives them.
_STORED_HEADERS: dict[bytes, Any] = {}
#: Those of them that a Response holds as they are (checked once, by _str_pairs()): what
#: replayed() answers from.
_REPLAYABLE: dict[bytes, tuple[tuple[str, str], ...]] = {}


def json_value(text: str) -> Any:
    """A JSON text (a stored jsonb value's, a stored result's), parsed as ``json.loads`` would.

    The common case goes straight to the json module's C scanner: ``json.loads`` wraps it in
    three Python calls and two regular-expression matches, which cost a replay more than the
    parse itself (8,000 client instructions of its 12,000). Anything the scanner does not take
    whole (leading whitespace, text after the value, an error) goes through ``json.loads``.
    """
    try:
        value, end = _SCAN(text, 0)
    except (StopIteration, ValueError):
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


_SCAN = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _bytes(value: bytes | None) -> bytes | None:
    return None if value is None else bytes(value)


def _int(value: bytes | None) -> int | None:
    return None if value is None else int.from_bytes(value, "big", signed=True)


def _time(value: bytes | None) -> datetime | None:
    # A timestamptz in binary: microseconds since 2000-01-01 UTC, a big-endian int64. Multiplying
    # a timedelta costs half of building one from keywords (4,000 instructions against 8,000).
    if value is None:
        return None
    microseconds: int = _INT64(value)[0]
    return _EPOCH + _MICROSECOND * microseconds


_INT64 = struct.Struct(">q").unpack
_MICROSECOND = timedelta(microseconds=1)
