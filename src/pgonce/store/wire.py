"""pgonce's own statements, several per round trip, straight through psycopg's libpq layer.

Measured on the key store's hot path, psycopg's Python work per statement (cursor, query
conversion, adapters, a wait on the event loop for each) cost more than the database did: about
40-100 µs of client CPU for each of BEGIN, claim, completion and COMMIT. Here a round trip is a
*batch*: its statements are queued in libpq's pipeline mode with their parameters already encoded,
flushed once, and their results read in one wait. pgonce's statements are prepared once per
connection (unless the connection has ``prepare_threshold = None``, as behind a transaction-mode
pooler), under names of their own that never meet psycopg's.

Only pgonce's statements travel here; the caller's statements keep going through psycopg. A batch
runs only on a connection that psycopg is not using for anything else: it holds the connection's
lock, and it refuses a connection in psycopg's pipeline mode (the store falls back to psycopg
there). After a batch the connection is in the state psycopg expects: pipeline mode off, every
result read, the transaction status whatever the statements left.

One generator (:func:`exchange`) does the protocol work for both I/O styles; :func:`round_trip`
drives it with psycopg's own waiting, :func:`async_round_trip` with the event loop's reader
callbacks (without psycopg's per-wait timer, which cost more than the rest of the round trip).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors, pq
from psycopg._queries import PostgresQuery
from psycopg.abc import Buffer, Params, PQGen, QueryNoTemplate
from psycopg.adapt import Transformer
from psycopg.generators import fetch_many, send
from psycopg.pq.abc import PGconn, PGresult
from psycopg.waiting import Ready, Wait

from pgonce.core.outcomes import ClaimRow

TEXT, BINARY = 0, 1
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_INVALID_STATEMENT_NAME = "26000"
# At most this many statements prepared per connection (a caller's queued writes included); more
# are sent unnamed, so that a stream of distinct queries cannot grow a session without bound.
MAX_PREPARED = 100

Param = Buffer | None


@dataclass(frozen=True, slots=True)
class Statement:
    """One of pgonce's statements, with ``$n`` placeholders and the format of each parameter."""

    sql: bytes
    formats: tuple[int, ...] = ()
    #: Parameter type OIDs; empty lets the server infer them from the statement.
    types: tuple[int, ...] = ()
    name: bytes = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(self.sql + repr(self.types).encode()).hexdigest()[:16]
        object.__setattr__(self, "name", f"_pgonce_{digest}".encode())


@dataclass(frozen=True, slots=True)
class Command:
    """A statement with its encoded parameters; a ``Statement`` without parameters is sent as is."""

    statement: Statement
    params: Sequence[Param] = ()


# Which of pgonce's statements each connection has prepared. Weak: a closed connection's entry
# goes with it. A DEALLOCATE ALL or DISCARD ALL behind pgonce's back is detected by its error
# (26000) and answered by forgetting the connection's entry.
_prepared: weakref.WeakKeyDictionary[PGconn, set[bytes]] = weakref.WeakKeyDictionary()


def forget_prepared(conn: psycopg.BaseConnection[Any]) -> None:
    """Forget what this connection prepared: the next batch prepares again."""
    _prepared.pop(conn.pgconn, None)


def begin_statement(conn: psycopg.BaseConnection[Any]) -> Statement:
    """The BEGIN that psycopg would send for this connection's transaction settings."""
    parts = [b"BEGIN"]
    if conn.isolation_level is not None:
        parts += [b"ISOLATION LEVEL", conn.isolation_level.name.replace("_", " ").encode()]
    if conn.read_only is not None:
        parts.append(b"READ ONLY" if conn.read_only else b"READ WRITE")
    if conn.deferrable is not None:
        parts.append(b"DEFERRABLE" if conn.deferrable else b"NOT DEFERRABLE")
    return _simple(b" ".join(parts))


_SIMPLE: dict[bytes, Statement] = {}


def _simple(sql: bytes) -> Statement:
    statement = _SIMPLE.get(sql)
    if statement is None:
        statement = _SIMPLE[sql] = Statement(sql)
    return statement


COMMIT = _simple(b"COMMIT")
ROLLBACK = _simple(b"ROLLBACK")


def usable(conn: psycopg.BaseConnection[Any]) -> bool:
    """Whether a batch may run here: the connection is open and not in psycopg's pipeline."""
    pgconn = conn.pgconn
    return pgconn.status == pq.ConnStatus.OK and pgconn.pipeline_status == pq.PipelineStatus.OFF


def _queue(conn: psycopg.BaseConnection[Any], commands: Iterable[Command]) -> list[bytes | None]:
    """Queue the commands in pipeline mode; per result to come, None for a command's, the name
    for a statement's preparation (recorded as prepared only once it succeeded: an earlier
    failure in the batch makes the server skip it)."""
    pgconn = conn.pgconn
    prepare = conn.prepare_threshold is not None
    prepared = _prepared.setdefault(pgconn, set()) if prepare else set()
    preparing: set[bytes] = set()
    results: list[bytes | None] = []
    pgconn.enter_pipeline_mode()
    for command in commands:
        statement = command.statement
        name = statement.name
        if not statement.formats:
            # No parameters (BEGIN, COMMIT): the extended protocol without a prepared name.
            pgconn.send_query_params(statement.sql, None)
        elif not prepare or (
            name not in prepared
            and name not in preparing
            and len(prepared) + len(preparing) >= MAX_PREPARED
        ):
            pgconn.send_query_params(
                statement.sql,
                command.params,
                param_types=statement.types or None,
                param_formats=statement.formats,
                result_format=BINARY,
            )
        else:
            if name not in prepared and name not in preparing:
                pgconn.send_prepare(name, statement.sql, statement.types or None)
                preparing.add(name)
                results.append(name)
            pgconn.send_query_prepared(
                name,
                command.params,
                param_formats=statement.formats,
                result_format=BINARY,
            )
        results.append(None)
    pgconn.pipeline_sync()
    return results


def _settle(
    conn: psycopg.BaseConnection[Any], expected: list[bytes | None], results: list[PGresult]
) -> list[PGresult]:
    """Record the preparations that succeeded; return one result per command."""
    ours = []
    for result, name in zip(results, expected, strict=True):
        if name is None:
            ours.append(result)
        elif result.status == pq.ExecStatus.COMMAND_OK:
            _prepared.setdefault(conn.pgconn, set()).add(name)
    return ours


def exchange(pgconn: PGconn, expected: int) -> PQGen[list[PGresult]]:
    """Flush what is queued, read ``expected`` results and the sync, and leave pipeline mode.

    Each statement answers with one result (``PIPELINE_ABORTED`` for those skipped after an
    error), then the sync's. A connection lost halfway (the server restarted, the network cut)
    answers with fewer: that is raised as :class:`psycopg.OperationalError`.
    """
    yield from send(pgconn)
    results: list[PGresult] = []
    for _ in range(expected):
        got = yield from fetch_many(pgconn)
        if not got:
            raise _lost(pgconn, results)
        results.extend(got)
    sync = yield from fetch_many(pgconn)
    if len(sync) != 1 or sync[0].status != pq.ExecStatus.PIPELINE_SYNC:
        raise _lost(pgconn, results + sync)
    pgconn.exit_pipeline_mode()
    return results


def _lost(pgconn: PGconn, results: list[PGresult]) -> psycopg.OperationalError:
    """The error for a batch whose answers stopped coming: the server's last words if any."""
    said = [r.error_message for r in results if r.status == pq.ExecStatus.FATAL_ERROR]
    message = said[-1] if said else pgconn.error_message
    text = message.decode("utf-8", "replace").strip() or "the connection was lost"
    return psycopg.OperationalError(text)


def failure(
    conn: psycopg.BaseConnection[Any], results: Sequence[PGresult]
) -> tuple[int, psycopg.Error] | None:
    """The first failed command of a batch: its index and its error; None when all succeeded."""
    for index, result in enumerate(results):
        if result.status == pq.ExecStatus.FATAL_ERROR:
            error = errors.error_from_result(result, encoding=conn.info.encoding)
            if error.sqlstate == _INVALID_STATEMENT_NAME:
                forget_prepared(conn)
            return index, error
    return None


def round_trip(conn: psycopg.Connection[Any], commands: Sequence[Command]) -> list[PGresult]:
    """Run ``commands`` in one round trip; return one result per command (see :func:`failure`)."""
    with conn.lock:
        _require_usable(conn)
        try:
            expected = _queue(conn, commands)
            results = conn.wait(exchange(conn.pgconn, len(expected)))
        except BaseException:
            _abandon(conn)
            raise
    return _settle(conn, expected, results)


async def async_round_trip(
    conn: psycopg.AsyncConnection[Any], commands: Sequence[Command]
) -> list[PGresult]:
    """Run ``commands`` in one round trip; return one result per command (see :func:`failure`)."""
    async with conn.lock:
        _require_usable(conn)
        try:
            expected = _queue(conn, commands)
            results = await _drive(exchange(conn.pgconn, len(expected)), conn.pgconn)
        except BaseException:
            _abandon(conn)
            raise
    return _settle(conn, expected, results)


def _require_usable(conn: psycopg.BaseConnection[Any]) -> None:
    if conn.closed:
        raise psycopg.OperationalError("the connection is closed")
    if not usable(conn):
        raise psycopg.ProgrammingError("a pgonce batch cannot run inside psycopg's pipeline")


def _abandon(conn: psycopg.BaseConnection[Any]) -> None:
    """A round trip interrupted halfway leaves results unread: the connection cannot go on.

    Closing it is the one safe answer (the server rolls back its open transaction, and a pool
    discards a closed connection); otherwise the next user would read this batch's results.
    """
    if conn.pgconn.pipeline_status != pq.PipelineStatus.OFF or conn.pgconn.is_busy():
        conn.pgconn.finish()


async def _drive(gen: PQGen[list[PGresult]], pgconn: PGconn) -> list[PGresult]:
    """Run a libpq generator on the event loop: one callback per wait, no timer."""
    loop = asyncio.get_running_loop()
    fileno = pgconn.socket
    try:
        wait = next(gen)
        while True:
            future: asyncio.Future[Ready] = loop.create_future()
            if wait & Wait.W:
                loop.add_writer(fileno, _wake, future, Ready.W)
            if wait & Wait.R:
                loop.add_reader(fileno, _wake, future, Ready.R)
            try:
                ready = await future
            finally:
                if wait & Wait.W:
                    loop.remove_writer(fileno)
                if wait & Wait.R:
                    loop.remove_reader(fileno)
            wait = gen.send(ready)
    except StopIteration as done:
        result: list[PGresult] = done.value
        return result
    except OSError as error:
        raise psycopg.OperationalError("connection socket closed") from error


def _wake(future: asyncio.Future[Ready], ready: Ready) -> None:
    if not future.done():
        future.set_result(ready)


def caller_command(
    conn: psycopg.BaseConnection[Any], query: QueryNoTemplate, params: Params | None
) -> Command:
    """A caller's statement (psycopg placeholders and adapters) as a command of a batch.

    psycopg's own query conversion does the work, so placeholders, adapters and types are
    exactly what ``conn.execute()`` would send. It lives in a private module (``psycopg._queries``)
    that has kept this interface since psycopg 3.0; tests/keys/test_batches.py exercises it.
    """
    converted = PostgresQuery(Transformer.from_context(conn))
    converted.convert(query, params)
    formats = tuple(converted.formats or ())
    shape = (converted.query, formats, converted.types)
    statement = _CALLERS.get(shape)
    if statement is None:
        if len(_CALLERS) >= MAX_CALLER_STATEMENTS:
            _CALLERS.clear()
        statement = _CALLERS[shape] = Statement(*shape)
    return Command(statement, converted.params or ())


# The caller's statements seen so far, so that a statement's name is hashed once, not per call.
_CALLERS: dict[tuple[bytes, tuple[int, ...], tuple[int, ...]], Statement] = {}
MAX_CALLER_STATEMENTS = 1000


# Parameter encoding: pgonce's own parameters are few and of known types.


def number(value: int | None) -> Param:
    return None if value is None else str(value).encode()


def timestamp(value: datetime | None) -> Param:
    return None if value is None else value.isoformat().encode()


# One encoder: json.dumps() with separators builds a new one per call.
_JSON = json.JSONEncoder(separators=(",", ":"))


def json_text(value: Any) -> bytes:
    return _JSON.encode(value).encode()


# Result decoding (binary format) of begin()'s claim: claim_insert's row (claimed_at) when it
# won, else claim_read's: restored, fingerprint, claimed_at, completed_at, response_status,
# response_headers (jsonb), response_body.


def claim_row(inserted: PGresult, stored: PGresult, encoding: str) -> ClaimRow:
    """The claim's facts from its INSERT and its read; ``encoding`` is the connection's."""
    if inserted.ntuples == 1:
        return ClaimRow("won", None, _time(inserted.get_value(0, 0)), None, None, None, None)
    assert stored.ntuples == 1, "claim_read returned no row"
    value = stored.get_value
    fingerprint = value(0, 1)
    if fingerprint is None:
        # The row the INSERT conflicted with went before the read (the sweeper, or by hand).
        return ClaimRow("gone", None, None, None, None, None, None)
    headers = value(0, 5)
    return ClaimRow(
        "existing",
        bytes(fingerprint),
        _time(value(0, 2)),
        _time(value(0, 3)),
        _int(value(0, 4)),
        None if headers is None else json.loads(bytes(headers)[1:].decode(encoding)),
        _bytes(value(0, 6)),
    )


def _bytes(value: bytes | None) -> bytes | None:
    return None if value is None else bytes(value)


def _int(value: bytes | None) -> int | None:
    return None if value is None else int.from_bytes(value, "big", signed=True)


def _time(value: bytes | None) -> datetime | None:
    if value is None:
        return None
    return _EPOCH + timedelta(microseconds=int.from_bytes(value, "big", signed=True))
