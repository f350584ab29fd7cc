"""The key store on an async psycopg connection.

Every call runs on the caller's connection and inside the caller's transaction: the claim, the
caller's writes and the stored response commit together, and a rollback frees the key. This file is
the source of ``_sync/keys.py`` (``tools/gen_sync.py``); edit this one.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Generic, TypeVar

import psycopg
from psycopg import AsyncConnection, AsyncPipeline
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from pgonce.config import DEFAULT_CLAIM_WAIT, DEFAULT_RETRY_AFTER, DEFAULT_SCHEMA, MIN_CLAIM_WAIT
from pgonce.core.outcomes import (
    Claim,
    InFlight,
    Replay,
    Response,
    Won,
    decide,
    validate_fingerprint,
    validate_key,
)
from pgonce.errors import UsageError
from pgonce.sql import Queries
from pgonce.store.common import claim_row, require_transaction
from pgonce.store.errors import translate_errors

Row = TypeVar("Row")


def _check_wait(wait: timedelta) -> None:
    if wait < MIN_CLAIM_WAIT:
        raise UsageError(
            f"a claim's wait must be at least {MIN_CLAIM_WAIT.total_seconds() * 1000:.0f} ms: it "
            "bounds every lock the claim's INSERT waits for, and under load a new key's INSERT "
            "can wait that long for an index page, which a shorter wait would report as in flight"
        )


class AsyncKeyStore:
    """Claims, completions and replays of keys in pgonce's ``keys`` table.

    ``wait`` bounds how long a duplicate waits for the original's open transaction before it is
    answered :class:`InFlight`; ``retry_after`` is what it is told to wait then. With
    ``store_server_errors`` false (the default) a response with status 500 or more is not stored:
    the key is released, so the client's retry runs the work again.
    """

    def __init__(
        self,
        *,
        schema: str = DEFAULT_SCHEMA,
        wait: timedelta = DEFAULT_CLAIM_WAIT,
        retry_after: int = DEFAULT_RETRY_AFTER,
        store_server_errors: bool = False,
    ) -> None:
        _check_wait(wait)
        self.schema = schema
        self.wait = wait
        self.retry_after = retry_after
        self.store_server_errors = store_server_errors
        self._sql = Queries("keys", schema)

    def stores(self, response: Response | None) -> bool:
        """Whether ``response`` is kept for replays (a 5xx is not, unless configured)."""
        return (
            response is None
            or response.status is None
            or response.status < 500
            or self.store_server_errors
        )

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
        validate_key(scope, key)
        validate_fingerprint(fingerprint)
        require_transaction(conn)
        if wait is not None:
            _check_wait(wait)
        wait_ms = int((wait or self.wait) / timedelta(milliseconds=1))
        params = {"scope": scope, "key": key, "fingerprint": fingerprint, "wait_ms": wait_ms}
        with translate_errors("claiming a key"):
            cur = conn.cursor(row_factory=tuple_row)
            await cur.execute(self._sql.claim, {**params, "now": now})
            row = await cur.fetchone()
        return decide(
            claim_row(row),
            scope=scope,
            key=key,
            fingerprint=fingerprint,
            retry_after=self.retry_after,
        )

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
        if not isinstance(claim, Won):
            raise UsageError("only a won claim can be completed")
        require_transaction(conn)
        if not self.stores(response):
            await self.release(conn, claim)
            return False
        with translate_errors("completing a key"):
            cur = await conn.execute(self._sql.complete, self._completion(claim, response, now))
        return cur.rowcount == 1

    @staticmethod
    def _completion(claim: Won, response: Response | None, now: datetime | None) -> dict[str, Any]:
        stored = response or Response()
        return {
            "scope": claim.scope,
            "key": claim.key,
            "status": stored.status,
            "headers": Jsonb([list(h) for h in stored.headers]),
            "body": stored.body,
            "now": now,
        }

    async def release(self, conn: AsyncConnection[Row], claim: Won) -> None:
        """Give up ``claim`` in the current transaction, so that a retry runs the work anew."""
        require_transaction(conn)
        with translate_errors("releasing a key"):
            await conn.execute(self._sql.release, {"scope": claim.scope, "key": claim.key})

    def once(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        *,
        wait: timedelta | None = None,
        now: datetime | None = None,
    ) -> AsyncOperation[Row]:
        """A transaction that claims ``(scope, key)`` on entry and completes it on exit.

        ::

            async with store.once(conn, scope, key, fp) as op:
                if op.won:
                    await conn.execute("INSERT INTO orders ...")
                    op.respond(Response(201, body=b"..."))
            return op.response  # the new one, or the stored one on a replay

        On an idle connection the block is a transaction of its own, run in pipeline mode: BEGIN
        and the claim travel in one round trip, and the block's statements, the completion and
        COMMIT in one more (statements whose results the block fetches add their own round trip;
        errors in the others surface when the block ends). Inside the caller's transaction the
        block is a savepoint (``conn.transaction()``). Either way an exception rolls back the
        claim with the block's writes, and so does a 5xx response that is not stored: nothing
        half-done commits and the key stays free.
        """
        return AsyncOperation(self, conn, scope, key, fingerprint, wait=wait, now=now)


class AsyncOperation(Generic[Row]):
    """One ``once()`` block; see :meth:`AsyncKeyStore.once`."""

    def __init__(
        self,
        store: AsyncKeyStore,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        *,
        wait: timedelta | None,
        now: datetime | None,
    ) -> None:
        self._store = store
        self._conn = conn
        self._args = (scope, key, fingerprint)
        self._wait = wait
        self._now = now
        # Exactly one of the two is used: a pipeline when this block owns the transaction, a
        # transaction() (a savepoint) when it runs inside the caller's.
        self._pipeline: AbstractAsyncContextManager[AsyncPipeline] | None = None
        self._transaction = conn.transaction()
        self._claim: Claim | None = None
        self.response: Response | None = None
        #: True once the response was stored (after the block, when this operation won).
        self.stored = False

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
        if not self.won:
            raise UsageError("only the operation that won the claim can respond")
        self.response = response

    async def __aenter__(self) -> AsyncOperation[Row]:
        scope, key, fingerprint = self._args
        if self._conn.info.transaction_status == TransactionStatus.IDLE:
            self._pipeline = pipeline = self._conn.pipeline()
            await pipeline.__aenter__()
        else:
            await self._transaction.__aenter__()
        try:
            if self._pipeline is not None and self._conn.autocommit:
                await self._conn.execute(b"BEGIN", prepare=False)
            # Pipelined, fetchone() inside claim() flushes BEGIN and the claim together.
            self._claim = await self._store.claim(
                self._conn, scope, key, fingerprint, wait=self._wait, now=self._now
            )
        except BaseException as error:
            if self._pipeline is not None:
                await self._abort(error)
            else:
                await self._transaction.__aexit__(type(error), error, error.__traceback__)
            raise
        if isinstance(self._claim, Replay):
            self.response = self._claim.response
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._pipeline is not None:
            await self._finish_pipelined(exc)
            return None
        if exc is None and isinstance(self._claim, Won):
            if not self._store.stores(self.response):
                rollback = psycopg.Rollback()
                return await self._transaction.__aexit__(type(rollback), rollback, None)
            try:
                self.stored = await self._store.complete(
                    self._conn, self._claim, self.response, now=self._now
                )
            except BaseException as error:
                await self._transaction.__aexit__(type(error), error, error.__traceback__)
                raise
        return await self._transaction.__aexit__(exc_type, exc, tb)

    async def _finish_pipelined(self, exc: BaseException | None) -> None:
        assert self._pipeline is not None
        if exc is not None:
            await self._abort(exc)
            return
        completion = None
        try:
            end = b"COMMIT"
            if isinstance(self._claim, Won):
                if self._store.stores(self.response):
                    # Queued, not translated: an error raised here belongs to one of the block's
                    # own statements, whose result arrived while this one was being sent.
                    completion = await self._conn.execute(
                        self._store._sql.complete,
                        self._store._completion(self._claim, self.response, self._now),
                    )
                else:
                    end = b"ROLLBACK"
            await self._conn.execute(end, prepare=False)
        except BaseException as error:
            # The pipeline is still open: leave it (discarding what is queued), then roll back.
            await self._abort(error)
            raise
        try:
            # One flush: the block's pending statements, the completion and COMMIT.
            await self._pipeline.__aexit__(None, None, None)
        except BaseException:
            # A statement failed and the server skipped the rest, COMMIT included. The pipeline
            # has been left by its own exit: only the transaction remains to roll back.
            await rollback_quietly(self._conn)
            raise
        self.stored = completion is not None and completion.rowcount == 1

    async def _abort(self, error: BaseException) -> None:
        assert self._pipeline is not None
        await self._pipeline.__aexit__(type(error), error, error.__traceback__)
        await rollback_quietly(self._conn)


async def rollback_quietly(conn: AsyncConnection[Row]) -> None:
    """Roll back after a failure without hiding it.

    The original error is what the caller must see: a rollback that fails too (the connection
    died) is dropped, and PostgreSQL rolls back a dead connection's transaction by itself.
    """
    with contextlib.suppress(psycopg.Error):
        await conn.rollback()
