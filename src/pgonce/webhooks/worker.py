"""Inbox workers: run each stored event's handler exactly once.

A worker loop claims a batch of due, pending events with ``FOR UPDATE SKIP LOCKED`` and, in that
same transaction, runs each event's handler on the same connection, then marks the events done.
The handler's writes and the "done" commit together or not at all, so each handler's effects are
applied exactly once (a handler may *run* more than once; only one run commits):

- a handler that raises rolls back: the whole batch while the worker runs without savepoints (the
  others' events stay pending and run again in the next batch), or just its savepoint during the
  :data:`CAREFUL_BATCHES` batches that follow a failure. Then its failure is recorded (attempts
  + 1, the error, the next attempt after an exponential backoff with jitter), and after the
  source's last attempt the event is dead-lettered; :meth:`replay` brings dead letters back;
- a batch whose COMMIT fails (a handler's write broke a deferred constraint) is retried one event
  per transaction, and the event whose commit fails alone gets the failure recorded in a
  transaction of its own;
- a worker that dies (kill -9, a lost connection) commits nothing: PostgreSQL rolls its
  transaction back and releases the rows' locks, and another worker claims them; the attempt is
  not counted;
- ``stop`` ends the loops after the batch at hand; a batch still running after
  ``shutdown_timeout`` is cancelled and rolled back. Either way nothing is lost.

Events with an ordering key are claimed only at the head of their key (see the ``claim`` query),
so they run one at a time, in arrival order, while other keys run in parallel. The out-of-order
policy ``drop`` advances a per-key watermark in the handler's transaction and records events older
than it as ``skipped`` without running the handler.

Wake-ups come from LISTEN on a dedicated, direct connection (a transaction-mode pooler cannot carry
LISTEN); a loop that heard nothing polls every ``poll_interval``, so a lost notification only adds
latency. inbox_store() notifies only while a loop is registered as waiting
(``inbox_waiting_workers``), because PostgreSQL serializes the commits of notifying transactions:
busy workers are not waiting, so under load deliveries commit side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import AsyncConnection

from pgonce.config import DEFAULT_SCHEMA, own_connect_kwargs
from pgonce.core.checks import (
    check_bool,
    check_connection,
    check_duration,
    check_int,
    check_strs,
    describe,
)
from pgonce.core.frozen import refuse_changes
from pgonce.core.inbox import (
    DeadLetter,
    InboxEvent,
    Retry,
    Status,
    after_failure,
    describe_error,
    needs_watermark,
    parse_json,
)
from pgonce.core.outage import FailureRun
from pgonce.core.throttle import Throttle
from pgonce.database import own_prepare_threshold
from pgonce.errors import (
    ConfigError,
    DatabaseUnavailable,
    HandlerCancelled,
    HandlerEndedTransaction,
    HandlerSwallowedError,
    HandlerTimeout,
    PgonceError,
    UsageError,
)
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store._async.notify import LISTEN_CHECK, hears
from pgonce.store.errors import describe_dsn, translated
from pgonce.store.timeouts import cut_by, server_setting
from pgonce.webhooks.failures import report_failure
from pgonce.webhooks.source import Source, by_name

log = logging.getLogger("pgonce.inbox")

# A module constant: TransactionStatus.IDLE costs an enum class's attribute lookup at each use.
_IDLE = psycopg.pq.TransactionStatus.IDLE
_INTRANS = psycopg.pq.TransactionStatus.INTRANS

#: Events claimed per transaction. One commit covers the whole batch, which is where the
#: throughput comes from; the batch's rows stay locked until its last handler finished, so sources
#: with slow handlers (HTTP forwards) want smaller batches.
DEFAULT_BATCH_SIZE = 50

#: Loops, each with its own connection, claiming side by side.
DEFAULT_CONCURRENCY = 2

#: How long a loop that heard no notification waits before it looks anyway: the latency a lost
#: notification (or a pooler that cannot LISTEN) adds at most.
DEFAULT_POLL_INTERVAL = timedelta(seconds=1)

#: A waiting loop's registration counts for a minute (inbox_store()); a listening loop renews it
#: at least this often, whatever its poll interval.
MAX_WAIT = timedelta(seconds=30)

#: A loop that registered as waiting and found nothing looks once more after this, before its long
#: sleep. A delivery whose inbox_store() looked for waiting loops just before the registration
#: committed sent no notification; if it committed only after the look that follows the
#: registration, neither saw the other. Its transaction ends within milliseconds of that check
#: (the store's statement, then COMMIT), so a second look this much later finds it; a delivery
#: slower than that is found by the poll, as a lost notification is.
SETTLE = timedelta(milliseconds=100)

#: How long ``stop`` waits for in-flight batches before cancelling (and so rolling back) them.
DEFAULT_SHUTDOWN_TIMEOUT = timedelta(seconds=30)

#: Pause before reconnecting after the database went away, so a restart is not hammered.
RECONNECT_DELAY = timedelta(seconds=1)

#: How long ``stop`` waits, after cancelling the batches that outlived ``shutdown_timeout``, for
#: them to end. A batch still running then has a handler that caught the cancellation and carried
#: on: its connection is closed (the server rolls the batch back) and the stop no longer waits.
IGNORED_CANCEL_GRACE = timedelta(seconds=1)


#: Batches that isolate each handler with a savepoint after a handler failed. Without one, a batch
#: costs two round trips however large it is, but a failure rolls the whole batch back and the
#: other events' handlers run again; failures come in bursts (a dependency is down), so after one
#: the worker pays the savepoints for a while rather than re-running handlers again and again.
CAREFUL_BATCHES = 10


class HandlerNotAsync(UsageError):
    """A source's handler returned something that cannot be awaited: a plain ``def``, not an
    ``async def``. It has run to its end by then, so its event is dead-lettered at once rather
    than retried: every retry would run it, and repeat its effects, again."""

    def __init__(self, source: str, returned: object) -> None:
        super().__init__(
            f"the handler of source {source!r} returned {describe(returned)}, not an awaitable: "
            "define it with async def (it ran once; its event is dead-lettered, not retried)"
        )


class _Outage(FailureRun):
    """A run of failures of one of the worker's connections: its first failure is logged with
    what happens next, the others at debug level, its end once; each is counted (metrics).
    The claim loops share one, so an outage is one line however many loops run."""

    __slots__ = ("next_step", "what")

    def __init__(
        self,
        connection: str,
        what: str,
        next_step: str,
        back: str,
        on_failure: Callable[[str, Exception], None] | None,
    ) -> None:
        super().__init__(
            log,
            f"{back} after %(count)d failures",
            None if on_failure is None else lambda error: on_failure(connection, error),
        )
        self.what = what
        self.next_step = next_step

    def lost(
        self,
        error: Exception,
        what: str | None = None,
        level: int = logging.WARNING,
        next_step: str | None = None,
    ) -> None:
        """``what`` failed (default: the connection's own words), logged at ``level`` with
        ``next_step`` (default: the connection's own)."""
        self.failed(
            error,
            "%(what)s (%(type)s: %(error)s); %(next)s",
            "%(what)s (%(count)d failures in a row): %(error)s",
            {"what": what or self.what, "next": next_step or self.next_step},
            level=level,
        )

    def refused(
        self, error: Exception, delay: timedelta, values: dict[str, str] | None = None
    ) -> None:
        """``error`` failed a batch of the claim loops, said for what it is: a ConfigError (a
        pooler in statement mode refusing every transaction) is no lost database, nor is a
        statement cut by a server-set statement_timeout or lock_timeout (``values``: those
        settings as the connection showed them, when known)."""
        if isinstance(error, ConfigError):
            self.lost(
                error,
                "inbox worker cannot run a batch",
                logging.ERROR,
                f"it tries again every {delay.total_seconds():g} s (the setting may change "
                "without a restart), and says so when a batch runs again",
            )
        elif (setting := cut_by(error)) is not None:
            value = (values or {}).get(setting)
            shown = f" ({value})" if value else ""
            self.lost(
                error,
                f"inbox worker batch was cut by the server's {setting}{shown}, not by a lost "
                "connection",
                next_step=f"it is likely set on the database or the role (ALTER DATABASE or "
                f"ALTER ROLE ... SET {setting}) or in the dsn's options; the batch is rolled "
                f"back and retried every {delay.total_seconds():g} s, its events stay pending "
                "(no attempt counted), and it says so when a batch runs again",
            )
        elif isinstance(error, DatabaseUnavailable | psycopg.OperationalError):
            self.lost(error)
        else:
            self.lost(error, "inbox worker batch failed", logging.ERROR)


class _HandlerFailed(Exception):
    """Carries a handler's failure out of a batch transaction, rolling the batch back."""

    def __init__(self, event: InboxEvent, error: Exception) -> None:
        super().__init__(f"the handler of {event.source}/{event.id} failed")
        self.event = event
        self.error = error


class _HandlerExited(BaseException):
    """Carries a handler's SystemExit (or another BaseException that is no cancellation, such
    as KeyboardInterrupt or a library's own) out of a batch transaction, rolling the batch back."""

    def __init__(self, event: InboxEvent, error: BaseException) -> None:
        super().__init__(
            f"the handler of {event.source}/{event.id} raised {type(error).__qualname__}"
        )
        self.event = event
        self.error = error


class _TransactionEnded(_HandlerFailed):
    """A handler ended the batch's transaction; ``unrun`` are the batch's events after it."""

    def __init__(self, event: InboxEvent, error: Exception, unrun: list[InboxEvent]) -> None:
        super().__init__(event, error)
        self.unrun = unrun


def _utcnow() -> datetime:
    return datetime.now(UTC)


@refuse_changes
@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one claimed batch came to."""

    claimed: int = 0
    done: int = 0
    skipped: int = 0
    retried: int = 0
    dead: int = 0


class InboxWorker:
    """Processes the inbox events of ``sources`` that have a handler.

    ``dsn`` is used for the loops' connections and, unless ``listen_dsn`` is given, for LISTEN
    (behind a transaction-mode pooler give ``listen_dsn`` a direct connection, or ``listen=False``
    to rely on polling). ``connect_kwargs`` go to :meth:`psycopg.AsyncConnection.connect` (for
    example ``prepare_threshold``).
    """

    def __init__(
        self,
        sources: Iterable[Source],
        *,
        dsn: str,
        schema: str = DEFAULT_SCHEMA,
        batch_size: int = DEFAULT_BATCH_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
        poll_interval: timedelta = DEFAULT_POLL_INTERVAL,
        shutdown_timeout: timedelta = DEFAULT_SHUTDOWN_TIMEOUT,
        listen: bool = True,
        listen_dsn: str | None = None,
        connect_kwargs: dict[str, Any] | None = None,
        clock: Callable[[], datetime] = _utcnow,
        on_batch: Callable[[BatchResult, float], None] | None = None,
        on_failure: Callable[[str, str], None] | None = None,
        on_connection_failure: Callable[[str, Exception], None] | None = None,
    ) -> None:
        check_int(batch_size, "batch_size")
        check_int(concurrency, "concurrency")
        check_duration(shutdown_timeout, "shutdown_timeout")  # read only when stopping
        if check_duration(poll_interval, "poll_interval") <= timedelta(0):
            raise UsageError("poll_interval must be positive")
        # Refused here, not as an AttributeError or a TypeError out of run()'s loops.
        for name, dsn_given in (("dsn", dsn), ("listen_dsn", listen_dsn or "")):
            if not isinstance(dsn_given, str):
                raise UsageError(f"{name} must be a str, not {describe(dsn_given)}")
        check_bool(listen, "listen")
        for name, hook, optional in (
            ("clock", clock, False),
            ("on_batch", on_batch, True),
            ("on_failure", on_failure, True),
            ("on_connection_failure", on_connection_failure, True),
        ):
            if not callable(hook) and not (optional and hook is None):
                raise UsageError(f"{name} must be callable, not {describe(hook)}")
        self.sources = {name: s for name, s in by_name(sources).items() if s.handles}
        if not self.sources:
            raise UsageError("an inbox worker needs at least one source with a handler")
        self.store = AsyncInboxStore(schema=schema)
        self.dsn = dsn
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        #: The second look's delay after a registration (:data:`SETTLE`).
        self.settle = SETTLE
        self.shutdown_timeout = shutdown_timeout
        self.listen = listen
        self.listen_dsn = listen_dsn or dsn
        self.connect_kwargs = own_connect_kwargs(connect_kwargs)
        # With PGONCE_POOLER unset, the first connection says whether psycopg may prepare.
        self._pooler_checked = False
        #: Whether the LISTEN connection was seen to receive a notification (checked once), and
        #: whether it was seen not to (a transaction-mode pooler): the loops then poll,
        #: unregistered.
        self._heard = False
        self._deaf = False
        self.clock = clock
        #: Called after every batch the loops ran, with its result and its seconds (metrics).
        self.on_batch = on_batch
        #: Called for every failed handler run with its source and reason (the exception's
        #: class name), for metrics.
        self.on_failure = on_failure
        #: Called for every failure of a connection of the worker, with the connection
        #: ("worker": the claim loops', "listen": LISTEN's) and the error, for metrics.
        self.on_connection_failure = on_connection_failure
        #: Holds back repeated reports of one failure: per (source, reason).
        self.throttle = Throttle()
        self._names = sorted(self.sources)
        self._turn = 0
        self._one_at_a_time = 0
        self._careful = 0
        #: Each claim loop's connection and the event whose handler runs on it, by loop task:
        #: what a stop closes, and names, when a handler ignores its cancellation.
        self._loop_conns: dict[asyncio.Task[Any], AsyncConnection[Any]] = {}
        self._running: dict[asyncio.Task[Any] | None, InboxEvent] = {}

    # -- one batch ------------------------------------------------------------------------------

    async def run_once(
        self,
        conn: AsyncConnection[Any],
        *,
        now: datetime | None = None,
        jitter: float | None = None,
    ) -> BatchResult:
        """Claim and process one batch on ``conn`` (not in a transaction), in one transaction.

        ``now`` is the clock for the claim, the backoff and the timestamps (default: the
        database's ``now()`` and :attr:`clock`); ``jitter`` fixes the backoff's random part.
        """
        check_connection(conn, AsyncConnection, "the inbox worker")
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            raise UsageError("run_once needs a connection outside a transaction")
        store = self.store
        finished: list[tuple[InboxEvent, Status]] = []
        failed: list[Retry | DeadLetter] = []
        events: list[InboxEvent] = []
        # After a batch failed at commit, claim one event at a time until the culprit is found.
        limit = 1 if self._one_at_a_time > 0 else self.batch_size
        self._one_at_a_time = max(0, self._one_at_a_time - 1)
        # Savepoints cost a round trip per event; they are used only while failures are recent.
        careful = self._careful > 0
        self._careful = max(0, self._careful - 1)
        try:
            async with conn.transaction():
                events = await self._claim(conn, limit, now)
                if careful and events:
                    await store.savepoint(conn)
                for number, event in enumerate(events, 1):
                    source = self.sources[event.source]
                    try:
                        status = await self._run_handler(conn, source, event, now)
                    except Exception as error:
                        # A cancellation (shutdown) is no Exception: it rolls the batch back.
                        if conn.closed and not conn.broken:
                            # The handler closed the connection, which rolled the batch back.
                            closed = _closed_by_handler(error)
                            raise _HandlerFailed(event, closed) from error
                        if conn.info.transaction_status == _IDLE:
                            # The handler ran COMMIT or ROLLBACK: the batch is no longer one
                            # transaction, and what its end left must be found out.
                            ended = error
                            if not isinstance(error, HandlerEndedTransaction):
                                ended = HandlerEndedTransaction(
                                    f"{HandlerEndedTransaction()} (and then raised "
                                    f"{describe_error(error)})"
                                )
                            raise _TransactionEnded(event, ended, events[number:]) from error
                        if not careful:
                            raise _HandlerFailed(event, error) from error  # rolls back the batch
                        await _end_savepoint(store.rollback_savepoint(conn), event)
                        failed.append(
                            await self._record_failure(conn, source, event, error, now, jitter)
                        )
                    except (asyncio.CancelledError, _HandlerExited):
                        raise  # the stop's cancellation: the batch rolls back
                    except BaseException as error:
                        # SystemExit, KeyboardInterrupt, a library's BaseException: they end
                        # the worker, counted first, or the same event ended every restart.
                        raise _HandlerExited(event, error) from error  # rolls the batch back
                    else:
                        finished.append((event, status))
                        if status == "skipped":
                            await store.skip(conn, event)
                    if careful:
                        # One round trip per event: release its savepoint, open the next one's.
                        if number < len(events):
                            await _end_savepoint(store.next_savepoint(conn), event)
                        else:
                            await _end_savepoint(store.release_savepoint(conn), event)
        except _HandlerExited as exited:
            await self._count_exit(conn, exited, now, jitter)
            raise exited.error from None
        except _TransactionEnded as ended:
            self._careful = CAREFUL_BATCHES
            return await self._after_transaction_ended(conn, ended, events, now, jitter)
        except _HandlerFailed as failure:
            # The batch rolled back, the failed handler's writes with it; the others' events are
            # still pending and run again in the next batch, with savepoints this time.
            self._careful = CAREFUL_BATCHES
            if conn.closed and not conn.broken:
                # Its handler closed the connection: the failure is recorded on one of its own
                # (the loop reconnects for the next batch).
                async with await self._connect(self.dsn, autocommit=False) as apart:
                    decision = await self._record_apart(
                        apart, failure.event, failure.error, now, jitter
                    )
            else:
                decision = await self._record_apart(conn, failure.event, failure.error, now, jitter)
            return BatchResult(
                claimed=len(events),
                retried=int(isinstance(decision, Retry)),
                dead=int(isinstance(decision, DeadLetter)),
            )
        except psycopg.Error as error:
            # Statements inside the block raise pgonce's errors; a raw psycopg error other than a
            # lost connection comes from COMMIT: a handler's write broke a deferred constraint.
            if isinstance(error, psycopg.OperationalError) or not events:
                raise
            return await self._commit_failed(conn, events, error, now, jitter)
        return BatchResult(
            claimed=len(events),
            done=sum(1 for _, s in finished if s == "done"),
            skipped=sum(1 for _, s in finished if s == "skipped"),
            retried=sum(1 for d in failed if isinstance(d, Retry)),
            dead=sum(1 for d in failed if isinstance(d, DeadLetter)),
        )

    async def _claim(
        self, conn: AsyncConnection[Any], limit: int, now: datetime | None
    ) -> list[InboxEvent]:
        """Up to ``limit`` events, one claim per source until the batch is full. The first source
        asked rotates from batch to batch, so a busy source cannot starve the others."""
        names = self._names
        self._turn = (self._turn + 1) % len(names)
        events: list[InboxEvent] = []
        for name in names[self._turn :] + names[: self._turn]:
            events += await self.store.claim(
                conn,
                name,
                limit=limit - len(events),
                blocking=self.sources[name].head_failure == "block",
                now=now,
            )
            if len(events) >= limit:
                break
        return events

    async def _count_exit(
        self,
        conn: AsyncConnection[Any],
        exited: _HandlerExited,
        now: datetime | None,
        jitter: float | None,
    ) -> None:
        """A handler raised SystemExit (or another BaseException that is no cancellation), which
        ends the worker as it asks; its run is counted first, so that an event whose handler
        always exits is dead-lettered in the end rather than run again at every start."""
        event = exited.event
        try:
            await self._record_apart(conn, event, exited.error, now, jitter)
        except (PgonceError, psycopg.Error) as error:
            log.error(
                "the handler of %s event %s raised %s: the worker stops as asked, its "
                "batch rolled back; the failure could not be recorded (%s), so the event runs "
                "again at the next start with this attempt not counted",
                event.source,
                event.id,
                type(exited.error).__qualname__,
                describe_error(error),
            )
            return
        log.error(
            "the handler of %s event %s raised %s: the worker stops as asked (its batch "
            "rolled back, the attempt counted as a failure)",
            event.source,
            event.id,
            type(exited.error).__qualname__,
        )

    async def _record_apart(
        self,
        conn: AsyncConnection[Any],
        event: InboxEvent,
        error: BaseException,
        now: datetime | None,
        jitter: float | None,
    ) -> Retry | DeadLetter:
        """Record the failure of a handler whose batch rolled back, in a transaction of its own."""
        async with conn.transaction():
            return await self._record_failure(
                conn, self.sources[event.source], event, error, now, jitter, claimed=False
            )

    async def _after_transaction_ended(
        self,
        conn: AsyncConnection[Any],
        ended: _TransactionEnded,
        events: list[InboxEvent],
        now: datetime | None,
        jitter: float | None,
    ) -> BatchResult:
        """A handler ran COMMIT or ROLLBACK on the batch's transaction. Committed: the events
        before it are done with their handlers' writes; its own event is dead-lettered (what
        its handler wrote before the COMMIT stays, and running it again could repeat that); the
        events after it were marked done without running, and are set back to pending. Rolled
        back: the batch is undone, and the event is retried like any failure."""
        event, error = ended.event, ended.error
        source = self.sources[event.source]
        async with conn.transaction():
            committed = await self.store.claim_committed(conn, event)
            if committed:
                await self.store.fail(
                    conn, event, DeadLetter(), describe_error(error), claimed=True, now=now
                )
                reopened = await self.store.reopen(conn, ended.unrun)
                decision: Retry | DeadLetter = DeadLetter()
            else:
                decision = await self._record_failure(
                    conn, source, event, error, now, jitter, claimed=False
                )
        if committed:
            log.error(
                "the handler of %s event %s ran COMMIT on the worker's transaction: the %d "
                "event(s) before it are done, it is dead-lettered (what it wrote before the "
                "COMMIT stays; check it, then replay it with `pgonce replay --source %s "
                "--event-id %s`), and the %d after it are pending again",
                event.source,
                event.id,
                len(events) - len(ended.unrun) - 1,
                event.source,
                event.id,
                reopened,
            )
            if self.on_failure is not None:
                self.on_failure(event.source, type(error).__qualname__)
        return BatchResult(
            claimed=len(events),
            done=len(events) - len(ended.unrun) - 1 if committed else 0,
            retried=int(isinstance(decision, Retry)),
            dead=int(isinstance(decision, DeadLetter)),
        )

    async def _commit_failed(
        self,
        conn: AsyncConnection[Any],
        events: list[InboxEvent],
        error: psycopg.Error,
        now: datetime | None,
        jitter: float | None,
    ) -> BatchResult:
        if len(events) > 1:
            # Which handler broke the commit is unknown: retry these events one per transaction.
            log.warning("an inbox batch failed at commit (%s); retrying one by one", error)
            self._one_at_a_time = len(events)
            return BatchResult(claimed=len(events))
        (event,) = events
        async with conn.transaction():
            decision = await self._record_failure(
                conn, self.sources[event.source], event, error, now, jitter, claimed=False
            )
        return BatchResult(
            claimed=1,
            retried=int(isinstance(decision, Retry)),
            dead=int(isinstance(decision, DeadLetter)),
        )

    async def _record_failure(
        self,
        conn: AsyncConnection[Any],
        source: Source,
        event: InboxEvent,
        error: BaseException,
        now: datetime | None,
        jitter: float | None,
        *,
        claimed: bool = True,
    ) -> Retry | DeadLetter:
        at = now or self.clock()
        decision: Retry | DeadLetter
        if isinstance(error, HandlerNotAsync):
            decision = DeadLetter()  # it ran to its end: a retry would only repeat its effects
        else:
            decision = after_failure(source.retry, event.attempts, now=at, jitter=jitter)
        await self.store.fail(
            conn, event, decision, describe_error(error), claimed=claimed, now=now
        )
        reason = type(error).__qualname__
        if self.on_failure is not None:
            self.on_failure(event.source, reason)
        report_failure(self.throttle, event, error, decision, at)
        return decision

    async def _run_handler(
        self,
        conn: AsyncConnection[Any],
        source: Source,
        event: InboxEvent,
        now: datetime | None,
    ) -> Status:
        if needs_watermark(source.out_of_order, event) and not await self.store.advance_watermark(
            conn, event, now=now
        ):
            return "skipped"
        if source.json_required:
            event = replace(event, payload=parse_json(event.body))
        handler = source.handler_for(event.payload, event.headers)
        if handler is None:
            return "done"  # an event type nobody handles: nothing to do, and nothing to retry
        task = asyncio.current_task()
        self._running[task] = event
        try:
            async with asyncio.timeout(source.handler_timeout.total_seconds()) as deadline:
                running = handler(event, conn)
                if not inspect.isawaitable(running):
                    raise HandlerNotAsync(source.name, running)
                await running
        except TimeoutError as error:
            raise HandlerTimeout(source.handler_timeout.total_seconds()) from error
        except asyncio.CancelledError as error:
            if task is not None and task.cancelling():
                raise  # the worker is being stopped: the batch rolls back
            # A task the handler awaited was cancelled, or the handler raised it: its failure,
            # which must not end the worker (nor stall the event, which would end it again).
            raise HandlerCancelled() from error
        except Exception as error:
            if task is not None and task.cancelling():
                # The stop cancelled it, it carried on and failed (the stop may have closed its
                # connection): a rolled-back batch like any cut one, no attempt counted.
                raise asyncio.CancelledError() from error
            raise
        finally:
            self._running.pop(task, None)
        if deadline.expired():
            # The handler caught the deadline's cancellation and returned: whatever it was doing
            # was cut at an arbitrary await, so its writes must not commit as a finished run.
            raise HandlerTimeout(source.handler_timeout.total_seconds())
        if task is not None and task.cancelling():
            # The same for the stop after the shutdown timeout: the batch rolls back.
            raise asyncio.CancelledError()
        status = conn.info.transaction_status
        if status != _INTRANS:
            if status == _IDLE:
                raise HandlerEndedTransaction()
            if status == psycopg.pq.TransactionStatus.INERROR:
                # The handler swallowed a database error: its writes cannot commit, so it failed.
                raise HandlerSwallowedError()
            if conn.closed and not conn.broken:
                raise _closed_by_handler(None)
        return "done"

    # -- loops -----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Process events until ``stop`` is set; then let in-flight batches finish (or roll back
        after ``shutdown_timeout``) and return."""
        if not isinstance(stop, asyncio.Event):
            # A threading.Event's wait() would block the event loop for good.
            raise UsageError(f"run() needs an asyncio.Event to stop it, not {describe(stop)}")
        wakes = [asyncio.Event() for _ in range(self.concurrency)]
        delay = f"{RECONNECT_DELAY.total_seconds():g} s"
        self._loop_outage = _Outage(
            "worker",
            "inbox worker lost the database",
            f"it reconnects every {delay}, and says so when a batch runs again",
            "inbox worker runs batches again",
            self.on_connection_failure,
        )
        self._listen_outage = _Outage(
            "listen",
            "inbox LISTEN connection failed",
            f"the workers poll every {self.poll_interval.total_seconds():g} s meanwhile, and it "
            f"reconnects every {delay}",
            "inbox LISTEN connection is back",
            self.on_connection_failure,
        )
        tasks = [asyncio.create_task(self._loop(stop, wake)) for wake in wakes]
        if self.listen:
            tasks.append(asyncio.create_task(self._listen(stop, wakes)))
        stopping = asyncio.create_task(stop.wait())
        abandoned: set[asyncio.Task[None]] = set()
        try:
            done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopping and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]  # a bug: say it loudly
            _, pending = await asyncio.wait(tasks, timeout=self.shutdown_timeout.total_seconds())
            for task in pending:
                task.cancel()
            cut = sum(1 for task in tasks[: self.concurrency] if task in pending)
            if cut:
                log.warning(
                    "inbox worker: %d batch(es) still running %g s after the stop (the shutdown "
                    "timeout) are cancelled: their handlers' writes are rolled back, and their "
                    "events run again when a worker runs (no attempt counted)",
                    cut,
                    self.shutdown_timeout.total_seconds(),
                )
            if pending:
                grace = IGNORED_CANCEL_GRACE.total_seconds()
                _, ignored = await asyncio.wait(pending, timeout=grace)
                for task in ignored:
                    await self._abandon(task)
                    abandoned.add(task)
        finally:
            stop.set()
            stopping.cancel()
            await asyncio.gather(*(t for t in tasks if t not in abandoned), return_exceptions=True)

    async def _abandon(self, task: asyncio.Task[None]) -> None:
        """Stop waiting for ``task``, a loop whose handler caught the stop's cancellation and
        carried on: its connection is closed, so the server rolls its batch back (its events
        stay pending, no attempt counted), and the stop ends within its bound."""
        task.add_done_callback(_forget)
        event = self._running.get(task)
        await _close(self._loop_conns.pop(task, None))
        what = "a handler" if event is None else f"the handler of {event.source} event {event.id}"
        log.warning(
            "inbox worker: %s ignored the stop's cancellation (it caught "
            "asyncio.CancelledError and carried on) %g s after it was cancelled: its "
            "connection is closed, so its batch is rolled back and its events stay pending, to "
            "run again when a worker runs (no attempt counted); the stop no longer waits for "
            "it, and the handler may still be running in this process. A handler lets "
            "CancelledError propagate",
            what,
            IGNORED_CANCEL_GRACE.total_seconds(),
        )

    async def _loop(self, stop: asyncio.Event, wake: asyncio.Event) -> None:
        conn: AsyncConnection[Any] | None = None
        # Names this loop in inbox_waiting_workers; unique per loop.
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        task = asyncio.current_task()
        assert task is not None  # run() creates each loop as a task
        try:
            while not stop.is_set():
                # Cleared before the claim: a notification during the batch means "look again".
                wake.clear()
                try:
                    if conn is None or conn.closed:
                        conn = await self._connect(self.dsn, autocommit=False)
                        self._loop_conns[task] = conn
                    started = time.perf_counter()
                    result = await self.run_once(conn)
                    if self.on_batch is not None and result.claimed:
                        self.on_batch(result, time.perf_counter() - started)
                except (PgonceError, psycopg.OperationalError) as raised:
                    # A batch's BEGIN runs outside the store's statements: PgBouncer in
                    # statement mode refuses it with an OperationalError, which is no outage.
                    error = translated(raised, "beginning an inbox batch")
                    values = await self._cut_settings(conn, error)
                    self._loop_outage.refused(error, RECONNECT_DELAY, values)
                    await _close(conn)
                    conn = None
                    await _wait(stop, None, RECONNECT_DELAY)
                    continue
                self._loop_outage.succeeded()
                if result.claimed < self.batch_size and not conn.closed:
                    try:
                        await self._wait_for_events(conn, stop, wake, name)
                    except (PgonceError, psycopg.OperationalError) as raised:
                        error = translated(raised, "registering an inbox worker as waiting")
                        values = await self._cut_settings(conn, error)
                        self._loop_outage.refused(error, RECONNECT_DELAY, values)
                        await _close(conn)
                        conn = None
                        await _wait(stop, None, RECONNECT_DELAY)
        finally:
            self._loop_conns.pop(task, None)
            await _close(conn)

    async def _cut_settings(
        self, conn: AsyncConnection[Any] | None, error: Exception
    ) -> dict[str, str]:
        """The server setting that cut ``error``'s statement, with its value, asked for only at
        the first failure of a run (the one that is logged)."""
        if self._loop_outage.in_a_row:
            return {}
        return await server_setting(conn, cut_by(error))

    async def _wait_for_events(
        self, conn: AsyncConnection[Any], stop: asyncio.Event, wake: asyncio.Event, name: str
    ) -> None:
        """Sleep until a notification, ``stop`` or the poll interval.

        Without listening this is a plain poll. With it, the loop registers as waiting (from
        then on inbox_store() notifies), looks once more, because an event committed just before
        the registration sent no notification, and again a :data:`SETTLE` later, for one whose
        store checked for waiting loops before the registration and committed after that look;
        it unregisters when it wakes. A registration counts for a minute, so the sleep is at
        most ``MAX_WAIT``.
        """
        if not self.listen or self._deaf:
            await _wait(stop, wake, self.poll_interval)
            return
        async with conn.transaction():
            await self.store.set_waiting(conn, name, True)
        try:
            longest = min(self.poll_interval, MAX_WAIT)
            settle = min(longest, self.settle)
            # Once right after the registration, once more a SETTLE later (see SETTLE).
            for pause in (settle, longest - settle):
                started = time.perf_counter()
                result = await self.run_once(conn)
                if self.on_batch is not None and result.claimed:
                    self.on_batch(result, time.perf_counter() - started)
                if result.claimed:
                    return
                await _wait(stop, wake, pause)
                if wake.is_set() or stop.is_set():
                    return
        finally:
            if not conn.closed:
                async with conn.transaction():
                    await self.store.set_waiting(conn, name, False)

    async def _listen(self, stop: asyncio.Event, wakes: list[asyncio.Event]) -> None:
        while not stop.is_set():
            try:
                conn = await self._connect(self.listen_dsn, autocommit=True)
                async with conn:
                    await self.store.listen(conn)
                    # Up to LISTEN_CHECK when no notification comes (a transaction-mode pooler):
                    # a stop meanwhile ends the check rather than wait for it.
                    heard = await _unless_stopped(stop, self._hearing(conn))
                    if not heard:
                        break
                    self._listen_outage.succeeded()
                    for wake in wakes:  # whatever was stored while nobody listened
                        wake.set()
                    while not stop.is_set():
                        async for _ in conn.notifies(timeout=0.5):
                            for wake in wakes:
                                wake.set()
            except (PgonceError, psycopg.Error, OSError) as error:
                self._listen_outage.lost(error)
                await _wait(stop, None, RECONNECT_DELAY)
        if self._deaf:
            await stop.wait()  # run() ends when one of its tasks does

    async def _hearing(self, conn: AsyncConnection[Any]) -> bool:
        """Whether ``conn``, listening, receives notifications (checked on the first connection
        that listens, see :func:`pgonce.store._async.notify.hears`); when it does not, says so
        once, and the loops poll without registering as waiting."""
        if self._heard:
            return True
        async with await self._connect(self.listen_dsn, autocommit=True) as sender:
            self._heard = await hears(conn, sender, self.store.channel)
        if not self._heard:
            self._deaf = True
            log.warning(
                "inbox worker: the LISTEN connection (%s) received no notification within %g s "
                "of one sent to it: a transaction-mode pooler between it and the server delivers "
                "none. The workers poll every %g s instead, and no longer ask deliveries to "
                "notify; give listen_dsn (PGONCE_LISTEN_DSN for the service) a direct "
                "connection to the server to be woken within milliseconds",
                describe_dsn(self.listen_dsn),
                LISTEN_CHECK.total_seconds(),
                self.poll_interval.total_seconds(),
            )
        return self._heard

    async def _connect(self, dsn: str, *, autocommit: bool) -> AsyncConnection[Any]:
        try:
            conn = await AsyncConnection.connect(dsn, autocommit=autocommit, **self.connect_kwargs)
        except psycopg.OperationalError as error:
            raise DatabaseUnavailable(f"connecting an inbox worker failed: {error}") from error
        if not self._pooler_checked and dsn == self.dsn:
            # The worker's own statements and its handlers' run on these connections.
            try:
                threshold = await own_prepare_threshold(conn, "an inbox worker")
            except BaseException as error:
                await conn.close()
                if isinstance(error, psycopg.OperationalError):
                    # Its check runs a transaction: a pooler in statement mode refuses it, which
                    # is the ConfigError naming the pool modes that work, not a lost database.
                    raise translated(error, "connecting an inbox worker") from error
                raise
            self.connect_kwargs = {**self.connect_kwargs, "prepare_threshold": threshold}
            self._pooler_checked = True
        return conn

    # -- dead letters ----------------------------------------------------------------------------

    async def replay(
        self,
        conn: AsyncConnection[Any],
        source: str,
        event_ids: Iterable[str] | None = None,
        *,
        now: datetime | None = None,
    ) -> list[str]:
        """Dead letters of ``source`` back to pending, committed; returns the replayed ids."""
        # Checked before list() would turn a lone id into its characters.
        ids = None if event_ids is None else check_strs(event_ids, "event_ids")
        check_connection(conn, AsyncConnection, "the inbox worker")
        async with conn.transaction():
            return await self.store.replay(conn, source, ids, now=now)


def _closed_by_handler(raised: Exception | None) -> HandlerEndedTransaction:
    """The failure of a handler that closed the worker's connection (and then ``raised``)."""
    if isinstance(raised, HandlerEndedTransaction):
        return raised  # said so already
    then = "" if raised is None else f"; and then raised {describe_error(raised)}"
    return HandlerEndedTransaction(
        f"the handler closed the worker's connection, which rolled its batch back{then}; a "
        "handler leaves the connection it is given open"
    )


async def _end_savepoint(step: Awaitable[None], event: InboxEvent) -> None:
    """Run ``step``, which ends ``event``'s savepoint; a savepoint that is gone was ended by the
    handler (a RELEASE or ROLLBACK TO of it in SQL): its failure, which rolls the batch back,
    rather than one of every batch that claims it."""
    try:
        await step
    except UsageError as error:  # the store's word for a savepoint that no longer exists
        if not isinstance(error.__cause__, psycopg.errors.InvalidSavepointSpecification):
            raise
        ended = HandlerEndedTransaction(
            f"{HandlerEndedTransaction()} (it ended the worker's savepoint: "
            f"{describe_error(error.__cause__)}); a handler opens savepoints of its own "
            "(conn.transaction()) and ends only those"
        )
        raise _HandlerFailed(event, ended) from error


async def _unless_stopped(stop: asyncio.Event, step: Awaitable[bool]) -> bool | None:
    """``step``'s result, or None, with ``step`` cancelled, once ``stop`` is set."""
    running = asyncio.ensure_future(step)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([running, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not running.done():
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    return running.result() if not running.cancelled() else None


def _forget(task: asyncio.Task[None]) -> None:
    """Retrieve the end of a loop the stop no longer waits for, so that asyncio logs nothing."""
    if not task.cancelled():
        task.exception()


async def _close(conn: AsyncConnection[Any] | None) -> None:
    if conn is not None and not conn.closed:
        # Closing a broken connection: nothing is left to save.
        with contextlib.suppress(psycopg.Error):
            await conn.close()


async def _wait(stop: asyncio.Event, wake: asyncio.Event | None, longest: timedelta) -> None:
    """Sleep until ``stop`` or ``wake`` is set, at most ``longest``."""
    waiters = [asyncio.ensure_future(stop.wait())]
    if wake is not None:
        waiters.append(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(waiters, timeout=longest.total_seconds(), return_when="FIRST_COMPLETED")
    finally:
        for waiter in waiters:
            waiter.cancel()
