"""The sweeper: bounded-batch deletion of pgonce rows older than their retention.

Guarantees:

- Every batch is its own short transaction with its own ``statement_timeout`` (SET LOCAL, so a
  pooled connection keeps no state); there is never one big DELETE.
- Concurrent sweepers, in any number of processes, take disjoint rows (``FOR UPDATE SKIP LOCKED``):
  they never wait for each other, never delete a row twice, and their counts add up.
- Only rows the target's ``delete_<target>`` statement calls deletable go: for the key store, a
  claim in flight is never deleted.
- A target's run stops at its first short batch, or at the batch cap; a stop request is honoured
  between batches.
- A target that fails does not stop the others: the run goes on to the next target and raises
  the first failure once every target was tried. The batches committed before it stay deleted;
  :func:`swept_before` reads from that failure how many rows each target lost, so that a failed
  run never reports as if it had deleted nothing.
- ctid is never needed for correctness: every target has a portable statement that joins on its
  primary key. On plain PostgreSQL a target's ``_by_ctid`` twin is used instead, for speed; where
  Citus is installed (or with ``ctid=False``) the portable one is.

The sweeper needs a connection of its own (idle, not inside a transaction): it commits each batch.
This file is the source of ``_sync/sweeper.py`` (``tools/gen_sync.py``); edit this one.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from time import monotonic
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus

from pgonce.config import DEFAULT_SCHEMA
from pgonce.core.checks import check_connection, check_duration, check_optional_time
from pgonce.core.outage import FailureRun
from pgonce.core.retention import (
    DEFAULT_SWEEP_EVERY,
    TARGETS,
    Ending,
    RetentionPolicy,
    SweepLimits,
    SweepResult,
    TargetSweep,
    after_batch,
    format_duration,
    policies_for,
)
from pgonce.errors import DatabaseError, UsageError
from pgonce.sql import Queries
from pgonce.store import wire
from pgonce.store._async.health import _Watchdog
from pgonce.store.common import check_schema
from pgonce.store.cursors import cursor
from pgonce.store.errors import read_only_refusal, translate_errors

if TYPE_CHECKING:
    # Only a type: the core runs without psycopg-pool; a caller who passes a pool has it.
    from psycopg_pool import AsyncConnectionPool

Row = TypeVar("Row")
log = logging.getLogger("pgonce.sweeper")

#: ``(target, rows deleted by this batch)``, called after every batch (progress lines, metrics).
OnBatch = Callable[[str, int], None]

#: The attribute of a run's failure that holds the rows it had deleted (see swept_before()).
_SWEPT = "pgonce_swept"


def swept_before(error: BaseException) -> dict[str, int] | None:
    """The rows a failed run had deleted, by target, in batches committed before ``error``.

    Every target of the run is named, 0 for one that deleted nothing (or was not reached); None
    when ``error`` did not come out of a sweep.
    """
    found = getattr(error, _SWEPT, None)
    return dict(found) if isinstance(found, dict) else None


def failure_summary(error: BaseException) -> str:
    """One line for a failed run: the failure, and what was deleted before it."""
    deleted = swept_before(error)
    if deleted is None:  # the run never started (no connection from the pool)
        return f"sweep failed: {error}"
    per_target = ", ".join(f"{target} {count:,}" for target, count in deleted.items())
    return (
        f"sweep failed after deleting {sum(deleted.values()):,} rows ({per_target}) in batches "
        f"committed before the failure: {error}"
    )


def _crossed(conn: AsyncConnection[Any], error: DatabaseError) -> UsageError | None:
    """The refusal for a run whose statements psycopg prepared met another client's names on a
    pooler's shared server session (42P05, counted as pgonce's batches count it by
    wire.names_failed()); None otherwise (the failure goes on as it is)."""
    if conn.prepare_threshold is None or not wire.names_failed(conn, error.__cause__):
        return None
    if not wire.statements_crossed():
        return None
    return UsageError(
        "the sweeper found a prepared statement's name taken by another client on the same "
        "server session (a transaction-mode pooler), and this connection prepares statements "
        f"(prepare_threshold={conn.prepare_threshold}): there psycopg's prepared statements are "
        "crossed between clients, and a query runs another client's statement under its name: "
        "create the connections (or the pool's kwargs) with prepare_threshold=None"
    )


def _explained(error: DatabaseError, target: str, limits: SweepLimits) -> DatabaseError:
    """A batch cut by a timeout, saying which bound cut it and what usually holds it back.

    PostgreSQL says only "canceling statement due to statement timeout" (or lock timeout): not
    which bound (the sweeper's own, or one the role or database sets), nor its value, nor where
    to look. Any other failure is returned as it is.
    """
    cause = error.__cause__
    if isinstance(cause, psycopg.errors.LockNotAvailable):
        detail = (
            "a lock on the table was not granted within the lock_timeout this role or database "
            "sets; something holds the table (a migration, a VACUUM FULL, a LOCK TABLE: see "
            "pg_locks), and the next run tries again"
        )
    elif isinstance(cause, psycopg.errors.QueryCanceled) and "statement timeout" in str(cause):
        detail = (
            "a batch did not finish within the sweeper's statement timeout of "
            f"{format_duration(limits.statement_timeout)}: the table is locked (a migration, "
            "a VACUUM FULL, a LOCK TABLE: see pg_locks), or a batch of "
            f"{limits.batch_size:,} rows is too slow for the server (a smaller batch size, or a "
            "longer statement timeout); the next run tries again"
        )
    else:
        return error
    explained = type(error)(f"sweeping {target} failed: {detail} ({cause})")
    # What the failure carried for its callers (a read-only refusal, a stall) goes with it.
    explained.__dict__.update(error.__dict__)
    return explained


class StopSignal(Protocol):
    """What tells a sweeper to stop: an ``asyncio.Event`` or a ``threading.Event``."""

    def is_set(self) -> bool: ...


class AsyncSweeper:
    """Deletes expired rows of every sweep target, in bounded batches.

    ``policies`` give the retention per target (and per scope); each was checked against its retry
    horizon when it was built. ``targets`` restricts which tables this sweeper serves. ``ctid``:
    ``None`` (default) joins batches on ctid when the server is plain PostgreSQL (no Citus), True
    always where a target has that path, False never.
    """

    def __init__(
        self,
        policies: Iterable[RetentionPolicy] = (),
        *,
        schema: str = DEFAULT_SCHEMA,
        limits: SweepLimits | None = None,
        targets: Iterable[str] | None = None,
        ctid: bool | None = None,
    ) -> None:
        # Checked here: a wrong limits or ctid failed only at the first sweep (AttributeError).
        if limits is not None and not isinstance(limits, SweepLimits):
            raise UsageError(f"limits must be a SweepLimits, not {type(limits).__name__}")
        if ctid is not None and not isinstance(ctid, bool):
            raise UsageError(f"ctid must be True, False or None, not {ctid!r}")
        self.schema = check_schema(schema)
        self.limits = limits or SweepLimits()
        self.policies = policies_for(policies, targets)
        self.ctid = ctid
        self._sql = Queries("sweep", schema)

    async def sweep(
        self,
        conn: AsyncConnection[Row],
        *,
        now: datetime | None = None,
        stop: StopSignal | None = None,
        on_batch: OnBatch | None = None,
    ) -> SweepResult:
        """One run over every target: batches until a short one, the cap, or ``stop`` is set.

        ``now`` replaces the server's clock (tests); ``None`` uses the server's ``now()`` per batch.
        A naive ``now`` is refused: the server would read it in the session's time zone, and a
        clock hours ahead deletes keys whose senders may still retry them.
        """
        check_connection(conn, AsyncConnection, self)
        check_optional_time(now)
        if conn.info.transaction_status != TransactionStatus.IDLE:
            raise UsageError(
                "the sweeper commits every batch on its own: give it a connection that is not "
                "inside a transaction"
            )
        started = monotonic()
        by_ctid = self.ctid
        if by_ctid is None:
            try:
                by_ctid = await self._plain_postgres(conn)
            except DatabaseError as error:
                if (refusal := _crossed(conn, error)) is not None:
                    raise refusal from error
                raise
        swept = []
        failure: DatabaseError | None = None
        # Every committed batch, counted as it commits: a failure later in the run takes them
        # with it (swept_before()), since they stay deleted whatever happens next.
        deleted = {policy.target: 0 for policy in self.policies}

        def counted(target: str, count: int) -> None:
            deleted[target] += count
            if on_batch is not None:
                on_batch(target, count)

        for policy in self.policies:
            use_ctid = by_ctid and TARGETS[policy.target].has_ctid_twin
            try:
                swept.append(await self._sweep_target(conn, policy, use_ctid, now, stop, counted))
            except DatabaseError as error:
                if (refusal := _crossed(conn, error)) is not None:
                    setattr(refusal, _SWEPT, deleted)
                    raise refusal from error
                # The failed batch rolled back alone: the targets after it are still swept, so
                # that one target failing run after run (a table locked, a batch that times out)
                # does not leave every later one to grow. Unless the connection is gone.
                if conn.closed or read_only_refusal(error):
                    # Gone, or a node that refuses every target's DELETE alike (a standby, a
                    # read-only default): one failure to say, not one a table.
                    setattr(error, _SWEPT, deleted)
                    raise
                if failure is None:
                    failure = error  # raised at the end, and logged by whoever catches it
                else:
                    log.warning("%s (besides the failure this run raises)", error)
        if failure is not None:
            setattr(failure, _SWEPT, deleted)
            raise failure
        return SweepResult(tuple(swept), monotonic() - started)

    async def _plain_postgres(self, conn: AsyncConnection[Row]) -> bool:
        # In a transaction of its own: on a non-autocommit connection a bare query would leave one
        # open, and every batch would then be a savepoint inside it instead of a transaction.
        watchdog = _Watchdog(conn, 2 * self.limits.statement_timeout.total_seconds())
        with translate_errors("checking for Citus"), watchdog:
            async with conn.transaction():
                cur = cursor(conn)
                await cur.execute(self._sql.plain_postgres)
                row = await cur.fetchone()
        return bool(row and row[0])

    async def _sweep_target(
        self,
        conn: AsyncConnection[Row],
        policy: RetentionPolicy,
        by_ctid: bool,
        now: datetime | None,
        stop: StopSignal | None,
        on_batch: OnBatch | None,
    ) -> TargetSweep:
        statement = getattr(self._sql, f"delete_{policy.target}" + ("_by_ctid" if by_ctid else ""))
        params = {**policy.params(now), "batch_size": self.limits.batch_size}
        deleted = batches = 0
        ending: Ending | None = None
        while ending is None:
            # Before every batch, a target's first too: a stop request that ended one target's
            # run must not let each target after it run a batch of its own.
            if stop is not None and stop.is_set():
                ending = "stopped"
                break
            if batches:
                await asyncio.sleep(self.limits.pause.total_seconds())
            try:
                with translate_errors(f"sweeping {policy.target}"):
                    count = await self._batch(conn, statement, params)
            except DatabaseError as error:
                raise _explained(error, policy.target, self.limits) from error.__cause__
            batches += 1
            deleted += count
            if on_batch is not None:
                on_batch(policy.target, count)
            ending = after_batch(count, batches, self.limits)
        return TargetSweep(policy.target, deleted, batches, ending, by_ctid)

    async def _batch(
        self, conn: AsyncConnection[Row], statement: bytes, params: dict[str, Any]
    ) -> int:
        # The statement timeout is the server's: on a stalled network its error never comes
        # back, and the watchdog closes the connection instead (the loop retries on a new one).
        deadline = 2 * self.limits.statement_timeout.total_seconds()
        with _Watchdog(conn, deadline):
            async with conn.transaction():
                await cursor(conn).execute(
                    self._sql.statement_timeout, {"timeout_ms": self.limits.timeout_ms}
                )
                cur = await cursor(conn).execute(statement, params)
                return max(cur.rowcount, 0)


async def sweep_every(
    pool: AsyncConnectionPool[Any],
    sweeper: AsyncSweeper,
    stop: StopSignal,
    *,
    every: timedelta = DEFAULT_SWEEP_EVERY,
    on_run: Callable[[SweepResult], None] | None = None,
    on_failure: Callable[[Exception], None] | None = None,
) -> None:
    """The in-process sweeper: a run now, then one every ``every``, until ``stop`` is set.

    A run takes a connection from ``pool`` and gives it back when done, so the sweeper holds none
    between runs. A run that fails on the database (or finds the pool busy or the server away for
    the pool's whole timeout) is tried again at the next tick: a failover or a timeout must not end
    the loop. The first failure of a run of them is logged as a warning, the others at debug
    level, and the run that succeeds again once more; each line says how many rows the failed
    run had deleted before it failed (:func:`swept_before`), and ``on_failure`` is called with
    every one (a counter). A stop request ends a run between batches.
    """
    if check_duration(every, "the sweep interval") <= timedelta(0):
        raise UsageError("the sweep interval must be positive")
    failures = FailureRun(log, "sweep succeeded again after %(count)d failures", on_failure)
    while not stop.is_set():
        try:
            async with pool.connection() as conn:
                result = await sweeper.sweep(conn, stop=stop)
        # psycopg's own errors too: the pool's timeout (PoolTimeout) and a connection that
        # breaks while the pool hands it over are raised by the pool, untranslated.
        # And the refusal of a pool whose connections prepare statements behind a pooler that
        # crossed their names (_crossed()): the pool's kwargs may be fixed without a restart.
        except (DatabaseError, psycopg.Error, UsageError) as error:
            if isinstance(error, UsageError) and not isinstance(error.__cause__, DatabaseError):
                raise
            failures.failed(
                error,
                "%(summary)s (%(type)s); it tries again every %(every)s",
                "%(summary)s (%(count)d failures in a row)",
                {"summary": failure_summary(error), "every": every},
            )
        else:
            failures.succeeded()
            log.info("%s", result.summary())
            if on_run is not None:
                on_run(result)
        await _wait(stop, every)


async def _wait(stop: StopSignal, delay: timedelta) -> None:
    # Slices of at most 50 ms: a stop request is honoured within one slice, and the same code
    # serves an asyncio.Event and (in the generated sync twin) a threading.Event.
    slices = max(1, math.ceil(delay / timedelta(milliseconds=50)))
    for _ in range(slices):
        if stop.is_set():
            return
        await asyncio.sleep(delay.total_seconds() / slices)
