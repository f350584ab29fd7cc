"""The key store on an async psycopg connection.

Every call runs on the caller's connection and inside the caller's transaction: the claim, the
caller's writes and the stored response commit together, and a rollback frees the key. This file is
the source of ``_sync/keys.py`` (``tools/gen_sync.py``); edit this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus
from psycopg.pq.abc import PGresult
from psycopg.types.json import Jsonb

from pgonce.config import (
    DEFAULT_CLAIM_WAIT,
    DEFAULT_POOLER,
    DEFAULT_RETRY_AFTER,
    DEFAULT_SCHEMA,
    TRANSACTION_POOLER,
    validate_pooler,
)
from pgonce.core.checks import check_bool, check_connection
from pgonce.core.fingerprint import FINGERPRINT_SIZE
from pgonce.core.outcomes import (
    QUICK_KEY_CHARS,
    Claim,
    InFlight,
    Replay,
    Response,
    Won,
    decide,
    validate_claim,
    validate_fingerprint,
    validate_key,
    validate_response,
    won,
)
from pgonce.errors import DatabaseUnavailable, NotInTransaction, PgonceError, UsageError
from pgonce.sql import Queries, positional
from pgonce.store import wire
from pgonce.store._async.counts import changed
from pgonce.store.common import (
    busy,
    check_key_settings,
    check_now,
    check_wait,
    check_writes,
    claim_row,
    complete_claimed,
    outside_blocks,
    require_free_transaction,
)
from pgonce.store.cursors import cursor
from pgonce.store.errors import translate_caller_errors, unencodable
from pgonce.store.wire import BINARY, TEXT, Command, async_round_trip

if TYPE_CHECKING:
    from psycopg.abc import Params
    from psycopg.abc import QueryNoTemplate as Query

Row = TypeVar("Row")

# The order of the parameters of the batched statements ($1, $2, ...).
_INSERT_PARAMS = ("scope", "key", "fingerprint", "now", "wait_ms")
_READ_PARAMS = ("scope", "key")
_COMPLETE_PARAMS = ("scope", "key", "status", "headers", "body", "now", "row")
_GUARDED_PARAMS = (*_COMPLETE_PARAMS, "xact")

# What a connection that cannot begin a transaction of pgonce's own is told.
_BEGIN_REFUSAL = (
    "begin() opens a transaction of its own: it needs an idle connection, outside a transaction "
    "and outside conn.pipeline(); inside one, use claim()"
)
_OWNED_REFUSAL = (
    "once(commit=True) commits a transaction of its own and needs an idle connection, outside a "
    "transaction and outside conn.pipeline(); inside the caller's transaction, call once() "
    "without commit=True"
)


class AsyncKeyStore:
    """Claims, completions and replays of keys in pgonce's ``keys`` table.

    ``wait`` bounds how long a duplicate waits for the original's open transaction before it is
    answered :class:`InFlight`; ``retry_after`` is what it is told to wait then. With
    ``store_server_errors`` false (the default) a response with status 500 or more is not stored:
    the key is released, so the client's retry runs the work again.

    ``pooler="pgbouncer-transaction"`` says that the connections go through a transaction-mode
    pooler that cannot keep prepared statements (PgBouncer before 1.21): the store's batches are
    then sent unnamed, and a connection that still lets psycopg prepare statements is refused
    with a :class:`~pgonce.errors.UsageError` (psycopg's would be crossed between clients).
    ``pooler="none"`` says that they do not: the store prepares its statements once per
    connection even where the connection's ``prepare_threshold`` is None (Django sets it so by
    default). With ``"auto"``, the default, it prepares them where psycopg may prepare its own,
    and sends them unnamed for the rest of the process once it meets a pooler's shared sessions.
    """

    def __init__(
        self,
        *,
        schema: str = DEFAULT_SCHEMA,
        wait: timedelta = DEFAULT_CLAIM_WAIT,
        retry_after: int = DEFAULT_RETRY_AFTER,
        store_server_errors: bool = False,
        pooler: str = DEFAULT_POOLER,
    ) -> None:
        wait_ms = check_key_settings(
            schema=schema,
            wait=wait,
            retry_after=retry_after,
            store_server_errors=store_server_errors,
        )
        self.pooler = validate_pooler(pooler)
        #: Whether this store's batches may use prepared statements, and whether they do so on
        #: a connection with ``prepare_threshold = None`` too (``pooler="none"``: the caller
        #: says there is no pooler; Django, for one, turns psycopg's preparing off by default).
        self._named = pooler != TRANSACTION_POOLER
        self._always = pooler == "none"
        self.schema = schema
        self.wait = wait
        self.retry_after = retry_after
        self.store_server_errors = store_server_errors
        self._sql = Queries("keys", schema)
        self._claim_insert = wire.Statement(
            positional(self._sql.claim_insert, _INSERT_PARAMS), (TEXT, TEXT, BINARY, TEXT, TEXT)
        )
        self._claim_read = wire.Statement(
            positional(self._sql.claim_read, _READ_PARAMS), (TEXT, TEXT)
        )
        formats = (TEXT, TEXT, TEXT, TEXT, BINARY, TEXT)
        self._complete_batched = wire.Statement(
            positional(self._sql.complete, _COMPLETE_PARAMS[:-1]), formats
        )
        self._complete_claimed = wire.Statement(
            positional(complete_claimed(schema), _COMPLETE_PARAMS), (*formats, BINARY)
        )
        # The completion of a claim in the transaction begin() opened (commit(), once(commit=True),
        # @idempotent): it fails when that transaction is over, so that the COMMIT after it does
        # not commit what ran after the end (see _ENDED_THEN_WROTE).
        self._complete_guarded = wire.Statement(
            positional(complete_claimed(schema) + _OWNED_GUARD, _GUARDED_PARAMS),
            (*formats, BINARY, BINARY),
        )
        self._wait_ms = wait_ms
        #: The wait as begin()'s claim sends it, made once.
        self._wait_param = b"%d" % wait_ms

    def stores(self, response: Response | None) -> bool:
        """Whether ``response`` is kept for replays (a 5xx is not, unless configured)."""
        return response is None or self.stores_status(response.status)

    def stores_status(self, status: int | None) -> bool:
        """Whether a response with ``status`` is kept for replays."""
        return status is None or status < 500 or self.store_server_errors

    async def claim(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        *,
        wait: timedelta | None = None,
        now: datetime | None = None,
    ) -> Claim:
        """Claim ``(scope, key)`` in the connection's current transaction.

        One statement: ``INSERT ... ON CONFLICT DO NOTHING``, then, only on a conflict, the stored
        row. Returns :class:`Won`, :class:`Replay` or :class:`InFlight`; raises
        :class:`~pgonce.errors.KeyMismatch` when the key was used with another fingerprint and
        :class:`~pgonce.errors.NotInTransaction` on an autocommit connection. The transaction stays
        usable whatever the outcome.
        """
        wait_ms = self._checked_wait_ms(conn, scope, key, fingerprint, wait)
        return await self._claim(conn, scope, key, fingerprint, wait_ms, now, self._sql.claim)

    async def _claim(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        wait_ms: int,
        now: datetime | None,
        statement: Query,
    ) -> Claim:
        # claim(), and once() in the caller's transaction inside psycopg's pipeline, with
        # claim_completed (a row born completed: once()'s savepoint ends with the completion or
        # rolls the claim back). The arguments were checked by the caller (_checked_wait_ms);
        # the connection's state is checked here, where it counts.
        require_free_transaction(conn, "claim()")
        self._check_pooled(conn)
        params = {
            "scope": scope,
            "key": key,
            "fingerprint": fingerprint,
            "wait_ms": wait_ms,
            "now": now if now is None else check_now(now),
        }
        with translate_caller_errors("claiming a key"):
            cur = cursor(conn)
            # Binary results: psycopg parses a timestamptz in text only in the ISO DateStyle.
            await cur.execute(statement, params, binary=True)
            row = await cur.fetchone()
        return decide(
            claim_row(row),
            scope=scope,
            key=key,
            fingerprint=fingerprint,
            retry_after=self.retry_after,
            conn=conn,
        )

    def _checked_wait_ms(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        wait: timedelta | None,
    ) -> int:
        """Refuse a bad connection, scope, key, fingerprint or wait; the wait in milliseconds."""
        # The checks' own tests first, so that the common case makes no call for them.
        if not isinstance(conn, AsyncConnection):
            check_connection(conn, AsyncConnection, self)
        if not (  # validate_key()'s common case, without its call
            type(scope) is str
            and type(key) is str
            and scope  # not empty (a str)
            and len(scope) <= QUICK_KEY_CHARS
            and key
            and len(key) <= QUICK_KEY_CHARS
            and "\x00" not in scope
            and "\x00" not in key
        ):
            validate_key(scope, key)
        if type(fingerprint) is not bytes or len(fingerprint) != FINGERPRINT_SIZE:
            validate_fingerprint(fingerprint)
        if wait is None:
            return self._wait_ms
        return check_wait(wait)

    def _check_pooled(self, conn: AsyncConnection[Row]) -> None:
        """Refuse a connection that would prepare statements behind a transaction-mode pooler:
        the configured one, or one found by a name another client took (42P05)."""
        if conn.prepare_threshold is None:
            return
        if (refusal := self._pooled_refusal(conn)) is not None:
            raise refusal

    def _crossed(self, conn: AsyncConnection[Row], error: BaseException) -> UsageError | None:
        """The refusal for ``error`` when it is psycopg's statement names meeting another
        client's on a pooler's shared server session (42P05, 26000), counted as pgonce's own
        batches count it (wire.names_failed()); None otherwise (the error goes on as it is)."""
        if conn.prepare_threshold is None or not wire.names_failed(conn, _psycopg_error(error)):
            return None
        return self._pooled_refusal(conn)

    def _pooled_refusal(self, conn: AsyncConnection[Row]) -> UsageError | None:
        if not self._named:
            why = 'the key store was given pooler="pgbouncer-transaction"'
        elif wire.statements_crossed():
            why = (
                "pgonce found a prepared statement's name taken by another client on the "
                "same server session (a transaction-mode pooler)"
            )
        else:
            return None
        return UsageError(
            f"{why}, and this connection prepares statements (prepare_threshold="
            f"{conn.prepare_threshold}): there psycopg's prepared statements are crossed between "
            "clients, and a query runs another client's statement under its name: create the "
            "connections (or the pool's kwargs) with prepare_threshold=None"
        )

    async def begin(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        *,
        wait: timedelta | None = None,
        now: datetime | None = None,
    ) -> Claim:
        """Open a transaction on an idle connection and claim ``(scope, key)`` in it.

        BEGIN and the claim's INSERT travel in one round trip. A won claim leaves the transaction
        open: run the work on ``conn``, then end it with :meth:`commit` (the completion and COMMIT
        in one more round trip), or with ``conn.rollback()``. A claim that did not win reads the
        stored row and ends the transaction in a second round trip (it wrote nothing); so does an
        :class:`InFlight` answered because the wait for a concurrent claim ran out (that wait
        aborted the transaction, and it was rolled back). Either way the connection is idle
        again, and :meth:`commit` knows. Outcomes and errors are those of :meth:`claim`; after
        an error the transaction has been rolled back.
        """
        wait_ms = self._checked_wait_ms(conn, scope, key, fingerprint, wait)
        claimed = await self._begin(conn, scope, key, fingerprint, wait_ms, now)
        if isinstance(claimed, tuple):
            # _won(), written out: this runs for every fresh key.
            return won(claimed[0], claimed[1], fingerprint, *wire.claimed(claimed[2]), conn)
        return claimed

    async def _begin(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        wait_ms: int,
        now: datetime | None,
        refusal: str = _BEGIN_REFUSAL,
        *,
        joined: bool = False,
    ) -> Claim | Owned:
        # begin() once its arguments were checked (by begin(), or by once() when it was called).
        # ``refusal``: what a connection that cannot begin here is told (once()'s own words).
        # A won claim is returned as the batch answered it (Owned): begin() and once() make
        # their Won of it, @idempotent completes it with _complete_owned() and needs none.
        #
        # ``joined``: once() in the caller's transaction, whose state the caller checked (in a
        # transaction, or idle with autocommit off). The same batches inside a savepoint: BEGIN
        # (only when no transaction is open yet), SAVEPOINT and the claim's INSERT in one round
        # trip; a duplicate's read with the savepoint rolled back and released in a second. A
        # failure rolls back to the savepoint, so the caller's transaction goes on as it was.
        pgconn = conn.pgconn
        if joined:
            end: Sequence[Command] = _LEAVE
        elif (
            pgconn.transaction_status != _IDLE
            or pgconn.status != _CONNECTION_OK
            or pgconn.pipeline_status != _PIPELINE_OFF
        ):  # not idle, or not wire.usable()
            if conn.closed:
                raise DatabaseUnavailable("claiming a key failed: the connection is closed")
            if _running(conn):
                raise UsageError(busy("begin()" if refusal is _BEGIN_REFUSAL else "once()"))
            raise UsageError(refusal)
        else:
            end = (_COMMIT,)
        if not self._named or wire._naming.crossed:  # wire.statements_crossed(), written out
            self._check_pooled(conn)
        encoding: str = pgconn._encoding  # wire.encoding(conn), written out
        if encoding == "ascii":
            encoding = "utf-8"
        try:
            scope_param, key_param = scope.encode(encoding), key.encode(encoding)
        except UnicodeEncodeError as error:
            raise UsageError(unencodable("claiming a key", error)) from error
        insert: Command = (
            self._claim_insert,
            (
                scope_param,
                key_param,
                fingerprint,
                None if now is None else wire.timestamp(check_now(now)),
                self._wait_param if wait_ms == self._wait_ms else b"%d" % wait_ms,
            ),
        )
        for attempt in _ATTEMPT_NUMBERS:
            # Each attempt: a failed one may have left the transaction open (joined: it rolled
            # back to the savepoint) or not begun it.
            if not joined:
                # wire.begin_statement(), its common case without its call: psycopg's own
                # properties and its default transaction settings.
                if (
                    wire._PLAIN.get(type(conn))
                    and conn._isolation_level is None
                    and conn._read_only is None
                    and conn._deferrable is None
                ):
                    claim: list[Command] = [_PLAIN_BEGIN, insert]
                else:
                    claim = [(wire.begin_statement(conn), wire.NO_PARAMS), insert]
            elif conn.pgconn.transaction_status == _IDLE:
                claim = [(wire.begin_statement(conn), wire.NO_PARAMS), _SAVEPOINT, insert]
            else:
                claim = [_SAVEPOINT, insert]
            try:
                results = await async_round_trip(
                    conn, claim, named=self._named, always=self._always
                )
                # wire.failure(), called only where its first test would not pass.
                if results[-1].status in _FAILED and (failed := wire.failure(conn, results)):
                    raise failed[1]
                inserted = results[-1]
                if inserted.ntuples == 1:  # the INSERT returned the row: this caller won
                    return scope, key, inserted
                # Another claim has the key: read it and end this transaction (or savepoint),
                # which wrote nothing, in one round trip.
                results = await async_round_trip(
                    conn,
                    [(self._claim_read, (scope_param, key_param)), *end],
                    named=self._named,
                    always=self._always,
                )
                # wire.failure(), called only where its first test would not pass.
                if results[-1].status in _FAILED and (failed := wire.failure(conn, results)):
                    raise failed[1]
                break
            except BaseException as error:
                if joined:
                    await leave_quietly(conn)
                else:
                    await rollback_quietly(conn)
                if attempt < _ATTEMPTS and _naming_failed(error):
                    # DEALLOCATE ALL or DISCARD ALL ran (prepare again), or a pooler's shared
                    # sessions were met (unnamed from now on): the batch began the transaction,
                    # which is rolled back, so running it again from BEGIN is safe.
                    continue
                if (reason := _waited_out(error)) is not None:
                    return InFlight(retry_after=self.retry_after, reason=reason)
                with translate_caller_errors("claiming a key"):
                    raise
        replayed = wire.replayed(results[0], encoding, fingerprint)
        if replayed is not None:  # the common case of decide(), decoded for it alone
            return replayed
        return decide(
            wire.stored_row(results[0], encoding),
            scope=scope,
            key=key,
            fingerprint=fingerprint,
            retry_after=self.retry_after,
        )

    async def commit(
        self,
        conn: AsyncConnection[Row],
        claim: Claim,
        response: Response | None = None,
        *,
        writes: Sequence[tuple[Query, Params | None]] = (),
        now: datetime | None = None,
    ) -> bool:
        """End the transaction :meth:`begin` opened; True when the response was stored.

        For a won claim, ``writes`` (statements with their parameters, as for
        ``conn.execute()``), the completion and COMMIT travel in one round trip. A response that
        is not stored (a 5xx, by default) rolls back the whole transaction instead, so the key
        is free and nothing half-done commits. A claim that did not win just commits. If
        anything fails, the transaction is rolled back and the error raised: a write's own
        error as psycopg raised it, the completion's as a pgonce error.
        """
        # _check_completion(won=False), its checks' common case without their calls.
        if (
            not isinstance(conn, AsyncConnection)
            or type(claim) not in _CLAIM_TYPES
            or (response is not None and type(response) is not Response)
        ):
            self._check_completion(conn, claim, response, won=False)
        return await self._commit(conn, claim, response, writes, now)

    async def _commit(
        self,
        conn: AsyncConnection[Row],
        claim: Claim,
        response: Response | None,
        writes: Sequence[tuple[Query, Params | None]],
        now: datetime | None,
        *,
        joined: bool = False,
    ) -> bool:
        # commit() for once()'s block: its claim is begin()'s own, its response was checked by
        # respond(). ``joined``: once()'s block in the caller's transaction, which ends its
        # savepoint instead of the transaction (RELEASE, or ROLLBACK TO and RELEASE).
        commands: list[Command] = []
        completing = guarded = False
        if not isinstance(claim, Won):
            if joined or conn.pgconn.transaction_status == _IDLE:
                return False  # _begin() already ended it
            if _running(conn):
                raise UsageError(busy("commit()"))
            commands.append(_COMMIT)
        elif (owner := claim.conn) is not conn and owner is not None:
            # A claim made on another connection: its row is in that connection's
            # transaction, which this completion cannot reach; this COMMIT would commit this
            # connection's transaction without its own claim's response.
            raise UsageError(busy("commit()") if _running(conn) else _OTHER_CONNECTION)
        elif (
            not joined
            and (txn := conn.pgconn.transaction_status) != _INTRANS
            and (txn == _IDLE or _running(conn))
        ):
            raise UsageError(_ENDED_BEFORE_COMMIT if txn == _IDLE else busy("commit()"))
        elif (
            response is not None
            and (status := response.status) is not None
            and status >= 500
            and not self.store_server_errors
        ):  # not stored (stores(), written out: this runs for every fresh key)
            commands.extend(_LEAVE if joined else _UNDO)
        else:
            completing = True
            # The connection's encoding now (the work may have changed it), read once for the
            # writes and the completion: each read asks libpq and maps the name.
            encoding: str = conn.pgconn._encoding
            try:
                for query, params in writes:
                    commands.append(wire.caller_command(conn, query, params, encoding))
                completion = _completion_params(
                    conn, claim, response or _NO_RESPONSE, now, encoding
                )
            except BaseException as error:
                # A queued write psycopg refused (its parameters), or a key that the
                # connection's encoding, changed by the work, cannot carry: nothing of the
                # block may stay in the transaction, as for any failure of the completion.
                await (leave_quietly if joined else rollback_quietly)(conn)
                if isinstance(error, ValueError | TypeError):
                    check_writes(writes, error)  # writes not of (query, params): say so
                raise
            if claim.row is None:  # a claim() of this transaction, not begin()'s
                commands.append((self._complete_batched, completion))
            elif joined:
                commands.append((self._complete_claimed, (*completion, claim.row)))
            else:
                commands.append((self._complete_guarded, (*completion, claim.row, claim.xact)))
                guarded = True
            commands.append((wire.RELEASE, wire.NO_PARAMS) if joined else _COMMIT)
        # _finish(), written out: one coroutine fewer between the block and its round trip.
        try:
            results = await async_round_trip(conn, commands, named=self._named, always=self._always)
        except BaseException:
            await (leave_quietly if joined else rollback_quietly)(conn)
            with translate_caller_errors("completing a key"):
                raise
        if results[-1].status in _FAILED and (failed := wire.failure(conn, results)):
            await self._failed(conn, commands, failed, joined=joined, owned=guarded)
        # The completion's answer, just before COMMIT's (or RELEASE's).
        return completing and results[-2].command_tuples == 1

    async def _finish(
        self,
        conn: AsyncConnection[Row],
        commands: list[Command],
        *,
        joined: bool = False,
        owned: bool = False,
    ) -> list[PGresult]:
        """Send the commands that end a transaction (the caller's writes, the completion,
        COMMIT or ROLLBACK) in one round trip; ``joined``, once()'s savepoint instead. If
        anything fails, the transaction (the savepoint) is rolled back and the error raised: a
        write's own error as psycopg raised it, and so COMMIT's refusal of the transaction's
        writes (a deferred constraint, a serialization failure); the completion's, or COMMIT's
        otherwise, as a pgonce error. ``owned``: the completion before COMMIT is
        _complete_guarded, whose guard's failure is raised as :data:`_ENDED_THEN_WROTE`."""
        try:
            results = await async_round_trip(conn, commands, named=self._named, always=self._always)
        except BaseException:
            await (leave_quietly if joined else rollback_quietly)(conn)
            with translate_caller_errors("completing a key"):
                raise
        if results[-1].status in _FAILED and (failed := wire.failure(conn, results)):
            await self._failed(conn, commands, failed, joined=joined, owned=owned)
        return results

    async def _failed(
        self,
        conn: AsyncConnection[Row],
        commands: list[Command],
        failed: tuple[int, psycopg.Error],
        *,
        joined: bool,
        owned: bool,
    ) -> NoReturn:
        """_finish()'s answer to a batch in which ``failed`` (the index and error of the first
        command that failed): roll back, and raise what _finish() says."""
        await (leave_quietly if joined else rollback_quietly)(conn)
        index, error = failed
        if joined and isinstance(error, psycopg.errors.InvalidSavepointSpecification):
            raise UsageError(_SAVEPOINT_GONE) from error
        if (
            owned
            and index == len(commands) - 2
            and isinstance(error, psycopg.errors.DivisionByZero)
        ):
            raise EndedThenWrote(_ENDED_THEN_WROTE) from error
        if (forget := wire.stale_plan(conn, commands[index][0], error)) is not None:
            # A caller's statement whose result type changed since it was prepared here
            # (an ALTER TABLE elsewhere, RETURNING *) fails so at every run: prepared anew
            # at the next one.
            with contextlib.suppress(psycopg.Error):
                await async_round_trip(conn, (forget,), named=False)
        if index < len(commands) - 2 or (
            index == len(commands) - 1 and isinstance(error, _REFUSED_AT_COMMIT)
        ):
            raise error  # one of the caller's writes, or what COMMIT found wrong in them
        with translate_caller_errors("completing a key"):
            raise error

    async def _complete_owned(
        self, conn: AsyncConnection[Row], owned: Owned, headers: bytes, body: bytes
    ) -> None:
        """_commit() of a claim that _begin() won, for a response with no status, its
        ``headers`` as they are stored (wire.headers_json()): the completion and COMMIT in one
        round trip, through _finish()."""
        scope, key, inserted = owned
        if conn.pgconn.transaction_status == _IDLE:
            raise UsageError(_ENDED_BEFORE_COMMIT)
        encoding = wire.encoding(conn)  # the connection's now: the work may have changed it
        try:
            scope_param, key_param = scope.encode(encoding), key.encode(encoding)
        except UnicodeEncodeError as error:
            await rollback_quietly(conn)
            raise UsageError(unencodable("completing a key", error)) from error
        completion = (
            scope_param,
            key_param,
            None,
            headers,
            body,
            None,
            *wire.row(inserted),
        )
        await self._finish(conn, [(self._complete_guarded, completion), _COMMIT], owned=True)

    async def complete(
        self,
        conn: AsyncConnection[Row],
        claim: Won,
        response: Response | None = None,
        *,
        now: datetime | None = None,
    ) -> bool:
        """Store ``response`` for ``claim`` in the current transaction; True when stored.

        False when the claim was already completed (a second completion changes nothing) or when
        the response is a 5xx that is not stored; then the claim is released instead, and the
        key is free once this transaction commits.
        """
        self._check_completion(conn, claim, response, won=True)
        require_free_transaction(conn, "complete()")
        if (owner := claim.conn) is not conn and owner is not None and _in_transaction(owner):
            # Its row is in that connection's open transaction, which this one cannot see: the
            # completion updated nothing and answered False, and that transaction then
            # committed the claim alone, in flight until the key expired. Once that transaction
            # ended, any connection sees what it committed (a stuck claim completed later).
            raise UsageError(_OTHER_CONNECTION)
        if not self.stores(response):
            await self.release(conn, claim)
            return False
        with translate_caller_errors("completing a key"):
            cur = await cursor(conn).execute(
                self._sql.complete, self._completion(claim, response, now)
            )
            return await changed(conn, cur) == 1

    async def committed(self, conn: AsyncConnection[Row], claim: Won) -> bool:
        """Whether ``claim`` committed, asked on ``conn`` with no transaction open after the
        caller's code ended the claim's transaction itself (:class:`EndedThenWrote`): its
        completion finds the row or not, in a transaction rolled back at once, so that nothing
        is stored and a committed claim stays in flight."""
        async with conn.transaction(force_rollback=True):
            return await self.complete(conn, claim, _NO_RESPONSE)

    def _check_completion(
        self, conn: AsyncConnection[Row], claim: Claim, response: object, *, won: bool
    ) -> None:
        check_connection(conn, AsyncConnection, self)
        validate_claim(claim, won=won)
        validate_response(response)

    @staticmethod
    def _completion(claim: Won, response: Response | None, now: datetime | None) -> dict[str, Any]:
        status, headers, body = _stored(response)
        return {
            "scope": claim.scope,
            "key": claim.key,
            "status": status,
            "headers": Jsonb(headers),
            "body": body,
            "now": now if now is None else check_now(now),
        }

    async def release(self, conn: AsyncConnection[Row], claim: Won) -> None:
        """Give up ``claim`` in the current transaction, so that a retry runs the work anew."""
        self._check_completion(conn, claim, None, won=True)
        require_free_transaction(conn, "release()")
        if (owner := claim.conn) is not conn and owner is not None and _in_transaction(owner):
            raise UsageError(_OTHER_CONNECTION)  # as in complete(): it deleted nothing
        with translate_caller_errors("releasing a key"):
            await cursor(conn).execute(self._sql.release, {"scope": claim.scope, "key": claim.key})

    async def _settle(
        self,
        conn: AsyncConnection[Row],
        claim: Won,
        response: Response | None,
        writes: Sequence[tuple[Query, Params | None]],
        now: datetime | None,
    ) -> bool:
        """Complete ``claim``, which a joined block's commit committed, in a transaction of its
        own on the idle ``conn``, with the block's queued ``writes``; False, with nothing
        written, when the claim is not there (the block rolled it back). See
        AsyncOperation._ended_in_block()."""
        if not wire.usable(conn):
            raise DatabaseUnavailable("completing a key failed: the connection is not usable")
        completion = (*_completion_params(conn, claim, response or _NO_RESPONSE, now), claim.row)
        begin: Command = (wire.begin_statement(conn), wire.NO_PARAMS)
        results = await self._finish(conn, [begin, (self._complete_claimed, completion)])
        if results[-1].command_tuples != 1:
            await self._finish(conn, list(_UNDO))
            return False
        commands = [wire.caller_command(conn, query, params) for query, params in writes]
        await self._finish(conn, [*commands, _COMMIT])
        return True

    def once(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        *,
        commit: bool = False,
        wait: timedelta | None = None,
        now: datetime | None = None,
    ) -> AsyncOperation[Row]:
        """A block that claims ``(scope, key)`` on entry and completes the claim on exit.

        ::

            async with store.once(conn, scope, key, fp) as op:
                if op.won:
                    await conn.execute("INSERT INTO orders ...")
                    op.respond(Response(201, body=b"..."))
            await conn.commit()
            return op.response  # the new one, or the stored one on a replay

        The block joins the caller's transaction and never ends it: the claim, the block's
        writes and the completion are a savepoint in it, and the caller's commit (``conn.commit()``,
        the exit of ``pool.connection()``, a SQLAlchemy ``session.commit()``, Django's
        ``atomic()``) commits them with everything else the transaction wrote. On a connection
        with autocommit off that has no transaction open yet, the block opens it as psycopg would
        for the connection's first statement (a BEGIN with the connection's isolation level and
        read-only setting). An exception in the block rolls back the savepoint -- the claim with
        the block's writes -- and propagates; so does a 5xx response that is not stored, without
        the exception: nothing half-done stays in the transaction and the key stays free.
        An autocommit connection outside a transaction has nothing to join:
        :class:`~pgonce.errors.NotInTransaction`.

        ``commit=True`` asks pgonce to own the transaction instead: on an idle connection
        (autocommit or not), :meth:`begin` on entry (BEGIN and the claim in one round trip) and
        :meth:`commit` on exit (the completion and COMMIT in one more), and the block's own
        statements run between the two. The work is committed when the block ends; an exception
        rolls it all back. A duplicate's transaction is over before its block runs: it read the
        stored response, having written nothing. It refuses a connection inside a transaction
        with :class:`~pgonce.errors.UsageError`: committing there would commit the caller's work.
        Inside the block the transaction is pgonce's, as if it were psycopg's own
        ``conn.transaction()``: ``conn.commit()`` and ``conn.rollback()`` raise
        ``psycopg.ProgrammingError`` (ending it there would commit the block's later writes
        without the claim), and a ``conn.transaction()`` in the block is a savepoint.
        """
        wait_ms = self._checked_wait_ms(conn, scope, key, fingerprint, wait)
        if commit is not False and commit is not True:
            # A truthy "false" (a setting read as text) owned and committed the transaction the
            # caller meant to join; a falsy one joined where it was meant to commit.
            check_bool(commit, "once()'s commit")
        # Positional: keywords cost the call a dict of them to bind.
        return AsyncOperation(self, conn, scope, key, fingerprint, commit, wait_ms, now)


class AsyncOperation(Generic[Row]):
    """One ``once()`` block; see :meth:`AsyncKeyStore.once`."""

    # What a new operation starts with, read from the class until the block sets its own:
    # eight stores fewer in every once().
    #
    # When the block joins the caller's transaction: its savepoint. None when the block owns
    # its transaction (commit=True: begin() and commit()).
    _savepoint: AbstractAsyncContextManager[Any] | None = None
    #: True when the block joined the caller's transaction through pgonce's batches (the
    #: savepoint is pgonce's own, see _begin()); psycopg's savepoint is in _savepoint.
    _joined = False
    _claim: Claim | None = None
    response: Response | None = None
    #: True once the response was stored (after the block, when this operation won).
    stored = False
    # The block runs once: entered (its claim made), then ended. A second block on the
    # same operation would run the first one's queued writes again; a respond() or an
    # execute() after the block would change nothing that was stored.
    _entered = False
    _ended = False
    #: True while the block's owned transaction is counted among psycopg's (see hold()).
    _held = False

    def __init__(
        self,
        store: AsyncKeyStore,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        commit: bool,
        wait_ms: int,
        now: datetime | None,
    ) -> None:
        self._store = store
        self._conn = conn
        self._args = (scope, key, fingerprint)
        self._owned = commit
        # once() checked the arguments when it was called; entering the block checks the
        # connection's state.
        self._wait_ms = wait_ms
        self._now = now
        self._writes: list[tuple[Query, Params | None]] = []
        # The rest (_savepoint, _joined, _claim, response, stored, _entered, _ended, _held)
        # starts as the class says.

    @property
    def claim(self) -> Claim:
        if self._claim is None:
            raise UsageError("the operation has not been entered")
        return self._claim

    @property
    def won(self) -> bool:
        return isinstance(self._claim, Won)

    @property
    def replayed(self) -> bool:
        return isinstance(self._claim, Replay)

    @property
    def in_flight(self) -> bool:
        return isinstance(self._claim, InFlight)

    def respond(self, response: Response) -> None:
        """Set the response that completes this claim when the block ends."""
        if self._ended or not isinstance(self._claim, Won):  # self.won, without its call
            raise UsageError(self._refusal("can respond"))
        if type(response) is not Response:
            validate_response(response)
        self.response = response

    def execute(self, query: Query, params: Params | None = None) -> None:
        """Queue a write that commits with the response, as ``conn.execute(query, params)`` would.

        For writes whose result the block does not need (an INSERT, an UPDATE): they run when
        the block ends, in order, just before the completion -- with ``commit=True`` in the
        same round trip as the completion and COMMIT, so a block of such writes costs two round
        trips in all. An error in one rolls the block back and is raised as psycopg raised it.
        Statements whose results the block reads go through ``conn`` as usual.
        """
        if self._ended or not isinstance(self._claim, Won):  # self.won, without its call
            raise UsageError(self._refusal("writes"))
        self._writes.append((query, params))

    def _refusal(self, does: str) -> str:
        if self._ended:
            return (
                f"the operation's block has ended: only the block {does}, and what it stored "
                "(or not) is final; call once() again for another claim"
            )
        return f"only the operation that won the claim {does}"

    async def __aenter__(self) -> AsyncOperation[Row]:
        if self._entered:
            raise UsageError(
                "an operation's block runs once: call once() again for another claim of the key"
            )
        scope, key, fingerprint = self._args
        conn = self._conn
        if self._owned:
            claimed = await self._store._begin(
                conn, scope, key, fingerprint, self._wait_ms, self._now, _OWNED_REFUSAL
            )
            if isinstance(claimed, tuple):
                # _won(), written out: this runs for every fresh key.
                self._claim = won(scope, key, fingerprint, *wire.claimed(claimed[2]), conn)
                # hold(conn, 1), written out; released first thing at the block's end.
                if hasattr(conn, "_num_transactions"):
                    conn._num_transactions += 1
                self._held = True
            else:
                self._claim = claimed
                if isinstance(claimed, Replay):  # the test below, for the owned block's replay
                    self.response = claimed.response
                self._entered = True
                return self
        elif (status := conn.pgconn.transaction_status) == _IDLE and conn.autocommit:
            if conn.pgconn.pipeline_status != _PIPELINE_OFF:
                raise NotInTransaction(_PIPELINE_OUTSIDE)
            raise NotInTransaction(
                "once() joins the caller's transaction, and an autocommit connection "
                "has none: open one (conn.transaction()), or pass commit=True"
            )
        elif status in (_IDLE, _INTRANS) and wire.usable(conn):
            # pgonce's batches, in a savepoint of their own (see _begin()).
            claimed = await self._store._begin(
                conn, scope, key, fingerprint, self._wait_ms, self._now, joined=True
            )
            self._claim = (
                _won(claimed, fingerprint, conn) if isinstance(claimed, tuple) else claimed
            )
            self._joined = True
        else:
            # In psycopg's pipeline (or a failed transaction, whose SAVEPOINT fails as psycopg
            # says): psycopg's savepoint around the claim() function.
            if conn.closed:
                raise DatabaseUnavailable("claiming a key failed: the connection is closed")
            if status == _INERROR:
                # psycopg's SAVEPOINT would fail with InFailedSqlTransaction, from in here.
                raise UsageError(
                    "once() joins the caller's transaction, which has failed (a statement "
                    "before it raised): roll it back (conn.rollback(), or leave its "
                    "conn.transaction() block) and claim in a new one"
                )
            if status == _ACTIVE and conn.pgconn.pipeline_status == _PIPELINE_OFF:
                # A statement under way outside the pipeline: a COPY block in progress, whose
                # lock on the connection psycopg's savepoint would wait for, for ever.
                raise UsageError(_BUSY)
            if conn.autocommit and status == _ACTIVE and outside_blocks(conn):
                # An autocommit pipeline outside conn.transaction(): psycopg's savepoint would
                # be a transaction of its own, committing the claim apart from the caller.
                raise NotInTransaction(_PIPELINE_OUTSIDE)
            store = self._store
            try:
                if status == _IDLE:
                    await _open_transaction(conn)
                self._savepoint = savepoint = conn.transaction()
                await savepoint.__aenter__()
            except Exception as error:
                # What psycopg's pipeline brings back here may be its own statements' names
                # crossed by a pooler's other clients: refused as pgonce's batches are.
                if (refusal := store._crossed(conn, error)) is not None:
                    raise refusal from error
                raise
            try:
                completed = store._sql.claim_completed
                self._claim = await store._claim(
                    conn, scope, key, fingerprint, self._wait_ms, self._now, completed
                )
            except BaseException as error:
                await savepoint.__aexit__(type(error), error, error.__traceback__)
                if (refusal := store._crossed(conn, error)) is not None:
                    raise refusal from error
                if (reason := _waited_out(error)) is None:
                    raise
                # Cut while it waited for a concurrent claim (a statement_timeout shorter than
                # the wait): in flight, as begin() answers. The savepoint ended with the claim,
                # so the block's end has nothing to end, as for a joined claim that did not win.
                self._claim = InFlight(retry_after=self._store.retry_after, reason=reason)
                self._joined = True
        if isinstance(self._claim, Replay):
            self.response = self._claim.response
        self._entered = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        claim = self._claim
        assert claim is not None
        self._ended = True
        if self._held:
            self._held = False
            if hasattr(conn := self._conn, "_num_transactions"):  # hold(conn, -1), written out
                conn._num_transactions -= 1
        if self._joined:
            if not isinstance(claim, Won):
                return None  # the savepoint ended with the claim
            conn = self._conn
            if exc is not None:
                if conn.pgconn.transaction_status == _IDLE:
                    # The block ended the transaction, then raised: its exception goes on, with
                    # what became of the claim (no response to store, nothing to roll back).
                    exc.add_note(_ENDED_THEN_RAISED)
                await leave_quietly(conn)
                return None
            if conn.pgconn.transaction_status == _IDLE:
                raise await self._ended_in_block(conn, claim)
            self.stored = await self._store._commit(
                conn, claim, self.response, self._writes, self._now, joined=True
            )
            return None
        savepoint = self._savepoint
        if savepoint is None:
            if exc is not None:
                await rollback_quietly(self._conn)
            elif type(claim) is not Won and self._conn.pgconn.transaction_status == _IDLE:
                pass  # _commit() would answer False: _begin() ended the transaction
            else:
                self.stored = await self._store._commit(
                    self._conn, claim, self.response, self._writes, self._now
                )
            return None
        if exc is None and isinstance(claim, Won):
            if not self._store.stores(self.response):
                rollback = psycopg.Rollback()
                return await savepoint.__aexit__(type(rollback), rollback, None)
            try:
                for query, params in self._writes:
                    await self._conn.execute(query, params)
                self.stored = await self._store.complete(
                    self._conn, claim, self.response, now=self._now
                )
            except BaseException as error:
                await savepoint.__aexit__(type(error), error, error.__traceback__)
                if (refusal := self._store._crossed(self._conn, error)) is not None:
                    raise refusal from error
                raise
        try:
            return await savepoint.__aexit__(exc_type, exc, tb)
        except _SAVEPOINT_ENDED as error:
            if exc is not None:
                raise
            # In psycopg's pipeline the block's end of the transaction is seen only here, when
            # psycopg's RELEASE finds no transaction (or no savepoint) any more: the completion
            # ran after that end, on its own, so it stored the response of a claim the block
            # committed, and found nothing of one it rolled back (the key is free).
            raise UsageError(_ENDED_IN_PIPELINE) from error
        except Exception as error:
            if error is exc or (refusal := self._store._crossed(self._conn, error)) is None:
                raise
            raise refusal from error

    async def _ended_in_block(self, conn: AsyncConnection[Row], claim: Won) -> UsageError:
        """The error for a joined block that ended the caller's transaction, with nothing run
        after the end (the connection is idle), once the key is settled as honestly as it can be.

        The block's commit (conn.commit(), or a COMMIT in SQL) committed the claim with what the
        block had written: the business writes are done, so a retry must replay their outcome,
        not wait on a claim in flight until the key expires, nor run them again. The block's
        response (a 5xx too: its writes could not be rolled back with the claim, as a 5xx's are)
        and its queued writes are then stored in a transaction of pgonce's own on the idle
        connection. The block's rollback took the claim with the writes: the key is free and
        nothing is stored. Which of the two happened is the claim's row, read by its ctid: an
        extra round trip on this misuse's path only.
        """
        try:
            self.stored = stored = await self._store._settle(
                conn, claim, self.response, self._writes, self._now
            )
        except Exception as error:
            failure = UsageError(
                f"{_ENDED_IN_BLOCK}; storing the response of the claim it committed failed "
                f"({error}), so the key stays in flight"
            )
            failure.__cause__ = error
            return failure
        if stored:
            return UsageError(
                f"{_ENDED_IN_BLOCK}; its commit had committed the claim with the block's writes, "
                "so the block's response was stored after it, and a retry replays it"
            )
        return UsageError(
            f"{_ENDED_IN_BLOCK}; the claim was rolled back with the block's writes before the "
            "end: nothing was stored and the key is free, so a retry runs the work again"
        )


async def _open_transaction(conn: AsyncConnection[Row]) -> None:
    """Open the transaction that psycopg would open for the next statement on ``conn``.

    The connection has autocommit off and no transaction yet: its owner (a SQLAlchemy session,
    Django's ``atomic()``, the caller's own ``conn.commit()`` later) will end the transaction
    that its first statement opens. pgonce's savepoint needs that transaction to exist first.
    """
    with translate_caller_errors("opening the caller's transaction"):
        if wire.usable(conn):
            begin: list[Command] = [(wire.begin_statement(conn), wire.NO_PARAMS)]
            for attempt in _ATTEMPT_NUMBERS:
                # A deallocated or pooler-shared name failed the BEGIN before it ran: again
                # (wire.failure() has switched to unnamed statements where the pooler shares).
                results = await async_round_trip(conn, begin)
                failed = wire.failure(conn, results)
                if not failed:
                    break
                if attempt == _ATTEMPTS or not _naming_failed(failed[1]):
                    raise failed[1]
        else:
            # In psycopg's pipeline pgonce's statements go through psycopg, whose BEGIN goes
            # ahead of the first one: an empty statement lets it send that BEGIN.
            await cursor(conn).execute(b"SELECT")


#: A claim that _begin() won: its scope and key, and the claim's result (the row's claimed_at
#: and ctid).
Owned = tuple[str, str, PGresult]

_NO_RESPONSE = Response()
# What commit() answers when the transaction begin() opened is over: the completion would run
# alone, find no claim, and COMMIT nothing, while the caller believed the response stored.
_ENDED_BEFORE_COMMIT = (
    "the transaction that begin() opened ended before commit() (a commit or rollback of the "
    "connection in between), so the response was not stored; a claim committed that way stays "
    "in flight until its key expires"
)


class EndedThenWrote(UsageError):
    """commit()'s (once(commit=True)'s, @idempotent's) refusal of a transaction that ended
    before it and had statements run after the end (:data:`_ENDED_THEN_WROTE`): everything
    since the end was rolled back, and the connection is idle. The HTTP middleware settles the
    claim after it, as after an endpoint that ended the transaction and ran nothing since."""


# What commit() (once(commit=True), @idempotent) answers when that transaction ended and
# statements ran after the end: on a connection with autocommit off psycopg opened a new
# transaction for them, which hides the end until the completion's guard finds it.
_ENDED_THEN_WROTE = (
    f"{_ENDED_BEFORE_COMMIT}. Statements ran after that end, in a new transaction (psycopg opens "
    "one for the next statement on a connection with autocommit off): they were rolled back "
    "with it, and nothing of that new transaction committed. A rollback had taken the claim "
    "with the writes before it, so the key is free and a retry runs the work again, whole; a "
    "commit had committed the claim with the writes before it"
)
# The guard that _complete_guarded adds to the completion by the row's ctid: a one-time filter,
# evaluated whether or not the row is found. The claim's INSERT (claim_insert) returned the id of
# its transaction (Won.xact); once that transaction has ended, the one open has another id, or
# none yet (no write since the end), and the division fails the batch before its COMMIT. The
# completion finding no row is not enough: it finds none after complete() or release() in the
# same transaction too, and it finds a claim that a COMMIT of the block committed. A setting the
# INSERT set for its transaction was not enough either: another begin() on the connection after
# the end sets it again, and this claim's commit() then committed that claim without its
# response, with what its transaction wrote. It costs the server a function call, a comparison
# and a division.
_OWNED_GUARD = (
    b" AND 1 / coalesce((pg_current_xact_id_if_assigned() = %(xact)s::xid8)::int, 0) >= 0"
)
_CLAIM_TYPES = (Won, Replay, InFlight)
# What once() on a connection busy with a statement outside psycopg's pipeline is told.
_BUSY = (
    "once() was given a connection that is running a statement: a COPY block (cur.copy()) in "
    "progress, or another thread's statement; inside a COPY block the claim would wait for the "
    "connection for ever. Claim before or after the COPY block, on a connection of this thread"
)
# What a joined once() on an autocommit connection in psycopg's pipeline, outside
# conn.transaction(), is told: not to pass commit=True, which that pipeline refuses too.
_PIPELINE_OUTSIDE = (
    "once() joins the caller's transaction, and this autocommit connection's pipeline runs "
    "outside one: open it (with conn.transaction(): ...) in the pipeline; commit=True needs a "
    "connection outside conn.pipeline()"
)
# What complete(), release() and commit() answer for a claim made on another connection.
_OTHER_CONNECTION = (
    "the claim was made (by claim() or begin()) on another connection: its row is in that "
    "connection's transaction, which no other connection sees; complete, release or commit it "
    "on the connection that claimed it. This connection's transaction was left as it was"
)
# What a joined once() block that ended the caller's transaction is told, then how its key was
# left (AsyncOperation._ended_in_block()).
_ENDED_IN_BLOCK = (
    "the transaction that once() joined ended inside its block (a conn.commit() or "
    "conn.rollback(), or a COMMIT or ROLLBACK in SQL, there): end it after the block, or pass "
    "commit=True for pgonce to own the transaction"
)
_ENDED_THEN_RAISED = (
    f"pgonce: {_ENDED_IN_BLOCK}; the block raised after that end, so no response was stored: a "
    "claim it committed stays in flight (with whatever the block wrote before its commit), one "
    "it rolled back left the key free"
)
# What psycopg's RELEASE of once()'s savepoint in its pipeline meets when the block ended the
# transaction: no transaction any more, or not the savepoint's.
_SAVEPOINT_ENDED = (
    psycopg.errors.NoActiveSqlTransaction,
    psycopg.errors.InvalidSavepointSpecification,
)
_ENDED_IN_PIPELINE = (
    f"{_ENDED_IN_BLOCK}; in psycopg's pipeline the completion ran after that end, on its own: "
    "the response of a claim the block committed was stored (a retry replays it), and a claim "
    "it rolled back left the key free"
)
# What it is told when it ended that transaction and went on in a new one (or released a
# savepoint opened before once()'s): pgonce's savepoint is gone and the completion failed.
_SAVEPOINT_GONE = (
    "once()'s savepoint was gone at the block's end: the transaction that once() joined ended "
    "inside its block (a conn.commit() or conn.rollback(), or a COMMIT or ROLLBACK in SQL) and "
    "the block went on in a new one, or a savepoint opened before pgonce's was released or "
    "rolled back inside it. Nothing was "
    "stored, and the transaction now open has failed: roll it back. A claim committed inside "
    "the block stays in flight (part of the block's work committed, part did not: neither a "
    "replay nor a new run would be right) until its key expires or is released by hand. The "
    "transaction ends after the block (or pass commit=True for pgonce to own it), and "
    "savepoints opened inside the block end inside it"
)

_COMMIT: Command = (wire.COMMIT, wire.NO_PARAMS)
#: BEGIN with psycopg's default transaction settings (what wire.begin_statement() gives then).
_PLAIN_BEGIN: Command = (wire._PLAIN_BEGIN, wire.NO_PARAMS)
# What COMMIT refuses a transaction for on account of its writes: the caller's to handle (a
# deferred foreign key the work broke, a serializable transaction to run again).
_REFUSED_AT_COMMIT = (psycopg.errors.IntegrityError, psycopg.errors.SerializationFailure)
_SAVEPOINT: Command = (wire.SAVEPOINT, wire.NO_PARAMS)
# What ends once()'s savepoint when the claim did not win, failed or is not stored.
_LEAVE: tuple[Command, ...] = ((wire.ROLLBACK_TO, wire.NO_PARAMS), (wire.RELEASE, wire.NO_PARAMS))
# What ends begin()'s transaction when its response is not stored.
_UNDO: tuple[Command, ...] = ((wire.ROLLBACK, wire.NO_PARAMS),)


def _in_transaction(conn: Any) -> bool:
    """Whether ``conn`` (the one a claim was made on) is still in a transaction: its claim's row
    is then invisible to any other connection."""
    return not conn.closed and conn.pgconn.transaction_status != _IDLE


def _running(conn: AsyncConnection[Any]) -> bool:
    """Whether ``conn`` runs a statement outside psycopg's pipeline (a COPY block), whose lock a
    round trip would wait for, for ever from inside the block."""
    pgconn = conn.pgconn
    return pgconn.transaction_status == _ACTIVE and pgconn.pipeline_status == _PIPELINE_OFF


# A module constant: TransactionStatus.IDLE costs an enum class's attribute lookup at each use.
_IDLE = TransactionStatus.IDLE
_INTRANS = TransactionStatus.INTRANS
_INERROR = TransactionStatus.INERROR
_ACTIVE = TransactionStatus.ACTIVE
_PIPELINE_OFF = psycopg.pq.PipelineStatus.OFF
# A batch's last result in one of these: a command failed (see wire.failure()).
_FAILED = frozenset(
    (int(psycopg.pq.ExecStatus.FATAL_ERROR), int(psycopg.pq.ExecStatus.PIPELINE_ABORTED))
)
_CONNECTION_OK = psycopg.pq.ConnStatus.OK


def _won(owned: Owned, fingerprint: bytes, conn: AsyncConnection[Row]) -> Won:
    """The :class:`Won` of a claim that ``_begin()`` answered as owned on ``conn``, from the
    claim's result."""
    scope, key, result = owned
    return won(scope, key, fingerprint, *wire.claimed(result), conn)


def _completion_params(
    conn: AsyncConnection[Row],
    claim: Won,
    stored: Response,
    now: datetime | None,
    encoding: str | None = None,
) -> tuple[wire.Param, ...]:
    """The completion's parameters but the claim's row: scope and key in the connection's
    encoding now (the work may have changed it), status, headers as stored, body, clock.
    ``encoding``: the connection's as psycopg names it, when the caller has just read it."""
    if encoding is None:
        encoding = conn.pgconn._encoding  # wire.encoding(conn), written out
    if encoding == "ascii":
        encoding = "utf-8"
    try:
        scope_param, key_param = claim.scope.encode(encoding), claim.key.encode(encoding)
    except UnicodeEncodeError as error:
        raise UsageError(unencodable("completing a key", error)) from error
    status, headers = stored.status, stored.headers
    # wire.headers_json()'s first test, without its call: the last response's headers again.
    last = wire._last_headers[0]
    return (
        scope_param,
        key_param,
        None if status is None else b"%d" % status,  # wire.number(), written out
        last[1] if headers is last[0] else wire.headers_json(headers),
        stored.body,
        None if now is None else wire.timestamp(check_now(now)),
    )


def _stored(response: Response | None) -> tuple[int | None, list[list[str]], bytes]:
    """The columns a completion writes: status, headers as [[name, value], ...], body."""
    stored = response or _NO_RESPONSE
    return stored.status, [list(h) for h in stored.headers], stored.body


def _waited_out(error: BaseException) -> str | None:
    """``InFlight``'s reason when a claim's INSERT failed on the concurrent claim it waited for.

    ``locked``: the wait ran out (lock_timeout), or the connection's statement_timeout (shorter
    than the wait) or a cancel request cut it while the INSERT waited for the concurrent claim's
    transaction (PostgreSQL's context for that wait names the index tuple); ``invisible``: the
    concurrent claim committed after this transaction's snapshot was taken (REPEATABLE READ or
    SERIALIZABLE). None for any other failure.
    """
    cause = _psycopg_error(error)
    if isinstance(cause, psycopg.errors.LockNotAvailable):
        return "locked"
    if isinstance(cause, psycopg.errors.QueryCanceled) and _WAITED_FOR_CLAIM in (
        cause.diag.context or ""
    ):
        return "locked"
    if isinstance(cause, psycopg.errors.SerializationFailure):
        return "invisible"
    return None


#: The context of a claim's INSERT cut while it waited for a concurrent claim's transaction
#: (XactLockTableWait()'s, in an English-speaking server).
_WAITED_FOR_CLAIM = "while inserting index tuple"

#: Runs of begin()'s batch: the first may meet a deallocated statement, the second a pooler's
#: shared session (which switches to unnamed statements), the third runs unnamed.
_ATTEMPTS = 3
#: Their numbers, made once rather than a range per claim.
_ATTEMPT_NUMBERS = range(1, _ATTEMPTS + 1)


def _naming_failed(error: BaseException) -> bool:
    """Whether a batch failed on a prepared statement's name: deallocated behind its back
    (26000), or taken by another client of the same server session (42P05)."""
    return isinstance(
        _psycopg_error(error),
        psycopg.errors.InvalidSqlStatementName | psycopg.errors.DuplicatePreparedStatement,
    )


def _psycopg_error(error: BaseException) -> BaseException | None:
    """The psycopg error behind ``error`` (pgonce's translation keeps it as the cause)."""
    return error.__cause__ if isinstance(error, PgonceError) else error


async def leave_quietly(conn: AsyncConnection[Row]) -> None:
    """Roll back to once()'s savepoint and release it after a failure, without hiding it.

    The caller's transaction goes on as it was before the block. Nothing to do when no
    transaction is open (the failure came before BEGIN ran); a failure of the rollback itself
    (the connection died) is dropped, as :func:`rollback_quietly` drops its own.
    """
    if wire.usable(conn) and conn.pgconn.transaction_status != _IDLE:
        with contextlib.suppress(psycopg.Error):
            await async_round_trip(conn, _LEAVE, named=False)


async def rollback_quietly(conn: AsyncConnection[Row]) -> None:
    """Roll back after a failure without hiding it.

    The original error is what the caller must see: a rollback that fails too (the connection
    died) is dropped, and PostgreSQL rolls back a dead connection's transaction by itself.
    """
    with contextlib.suppress(psycopg.Error):
        await conn.rollback()
