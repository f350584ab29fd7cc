"""The outbox relay: the loop that takes committed outbox rows to a broker.

One batch is one transaction on the relay's own connection: claim rows (``FOR UPDATE SKIP
LOCKED``), publish them, wait for the broker's acknowledgements, mark the acknowledged rows
published and record refusals, commit. What that guarantees:

- **No loss.** A row is marked published only after the broker acknowledged it, in the transaction
  that holds its lock. A relay that dies anywhere before the commit (SIGKILL, lost database
  connection) releases its rows; the next relay publishes them again with the same message id.
- **No double publishing between relays.** A locked row is skipped by every other relay, so
  several relays share the work without waiting on each other. Duplicates arise only where an
  acknowledgement was lost (the broker has the message, the mark did not commit), and then carry
  the same message id.
- **Order per aggregate.** enqueue() serializes the transactions that write one aggregate, so an
  aggregate's id order is its commit order; a relay only takes an aggregate through its oldest
  pending row, and publishes the aggregate's rows in id order. While one relay holds an aggregate,
  no other relay publishes any of its rows; the next one continues only after the first committed.
  Caveats, stated plainly: a parked row leaves the order (the rows behind it go on without it), and
  a broker that refuses row n but acknowledges row n+1 of the same batch has both of them
  out of order already (counted in :attr:`BatchReport.out_of_order`).
- **Outages wait.** A broker that cannot be reached leaves rows pending with no attempt counted;
  only refusals count towards parking.
- **A row's own failure is that row's.** What only one row can fail at (a routing function that
  raises for it, a body above the broker's size limit) is a refusal of that row by the publisher,
  never an exception out of the batch, which would stop every aggregate behind it; the rows of its
  aggregate behind it wait for it, and are not reported as lacking an answer.

Wake-up: a LISTEN on a dedicated connection (direct, never through a transaction-mode pooler)
wakes the loop when an enqueueing transaction commits; polling every ``poll_interval`` covers a
lost notification or a LISTEN connection that is down. enqueue() notifies only while some relay
is registered as waiting (``outbox_waiting_relays``), because PostgreSQL serializes the commits of
notifying transactions: a busy relay is not waiting, so under load business transactions commit
in parallel, and an idle relay is woken within milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict

from pgonce.config import DEFAULT_PREPARE_THRESHOLD, DEFAULT_SCHEMA, own_connect_kwargs
from pgonce.core.frozen import refuse_changes
from pgonce.core.outage import FailureRun
from pgonce.core.outbox import OutboxMessage, Refusal, RetryPolicy, refuse, settle
from pgonce.core.throttle import Throttle, held_back
from pgonce.database import own_prepare_threshold
from pgonce.errors import (
    BrokerUnavailable,
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    PgonceError,
)
from pgonce.publishers.base import Publisher, PublishResult, on_sending, outbox_origin
from pgonce.store._async.notify import hears
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store.errors import describe_dsn, translate_errors, translated
from pgonce.store.timeouts import cut_by, server_setting

log = logging.getLogger("pgonce.relay")

#: What a server answers a read of pg_control_system() with when it lets no one read it (a
#: revoked EXECUTE, a managed service) or has no such function.
_NO_CONTROL_DATA = (
    psycopg.errors.InsufficientPrivilege,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.FeatureNotSupported,
)

#: Rows per batch (one transaction, one round of confirms). A batch's database work (claim, mark,
#: commit) is shared by its rows: measured against JetStream, 200 rows reached 56 % of a raw
#: confirmed publish loop and 500 reached 66 %, while 1,000 added little more. A redelivery after a
#: crash stays small (the broker dedupes it by message id) and so do a batch's locks.
DEFAULT_BATCH_SIZE = 500
#: Most rows of one aggregate in a batch. It bounds what a claim reads per aggregate (a batch of
#: mostly single-event aggregates still fills up to the batch size) while letting one busy
#: aggregate move 50 events per round trip.
DEFAULT_PER_AGGREGATE = 50
#: Batches at the broker at once. A broker connection pipelines the messages of a batch already,
#: so more than two rarely help.
DEFAULT_CONCURRENCY = 2
#: Batch loops (each its own transaction and connection) per batch at the broker. With one, a
#: loop's database work (claim, mark, commit) adds to every batch's wait for acknowledgements and
#: the broker idles meanwhile (a relay with one loop per batch in flight fell to 76-79 % of a raw
#: confirmed RabbitMQ loop keeping as many batches in flight, where the database was slow); with
#: two, one loop claims or settles while the other's batch is at the broker.
LOOPS_PER_BATCH_IN_FLIGHT = 2
#: The polling fallback: the longest a committed row waits when a notification was lost.
DEFAULT_POLL_INTERVAL = timedelta(seconds=5)
#: A waiting relay's registration counts for a minute (outbox_enqueue()); it is renewed every
#: time the relay goes to sleep, so the poll interval must stay well below that.
MAX_POLL_INTERVAL = timedelta(seconds=30)
#: Waits after a batch the broker did not settle (down, or answers lost): from the first value
#: doubling to the second, so an outage costs a few connection attempts a minute, not a storm.
DEFAULT_OUTAGE_BACKOFF = (timedelta(milliseconds=200), timedelta(seconds=10))
#: How long a stop waits for a batch whose rows are at the broker to mark what the broker
#: acknowledged (a claim gets :data:`STOP_WAIT`, and then publishes nothing).
#: A statement that stalls (a lock another session holds, a server that stopped answering) is
#: cancelled after this, and the rows of the batch are published again by the next run, with the
#: same message ids.
DEFAULT_STOP_GRACE = timedelta(seconds=10)
#: How long a stop waits for a loop whose batch is not at the broker (claiming, registering as
#: waiting or unregistering) before it cancels the statement; a claim that ends after the stop
#: publishes nothing.
STOP_WAIT = timedelta(seconds=1)
#: What a batch loop does while its claimed batch has sent nothing and runs no statement: waits
#: for its turn at the broker ("queued") or for the publisher's connection ("connecting": its
#: prepare(), or a publish() that has not said a row went out, see Publisher). A stop
#: cancels it at once and says nothing of it; the claim rolls back and its rows wait for the next
#: run.
_NOTHING_SENT = frozenset({"queued", "connecting"})

#: A batch loop's doings whose rows were sent: waiting for the broker's answers ("settling"),
#: or marking them in the database ("marking"); a stop gives them the stop grace.
_AT_BROKER = frozenset({"settling", "marking"})

#: How long the LISTEN connection's first notification (one the relay sends itself) may take
#: before the relay concludes that notifications do not reach it.
LISTEN_CHECK = timedelta(seconds=5)

_T = TypeVar("_T")


@refuse_changes
@dataclass(frozen=True, slots=True)
class BatchReport:
    """What one batch did."""

    claimed: int = 0
    published: int = 0
    refused: int = 0
    parked: int = 0
    unsettled: int = 0
    out_of_order: int = 0
    #: The broker raised BrokerUnavailable (nothing of the batch reached it, as far as we know).
    broker_down: bool = False


@dataclass(slots=True)
class RelayStats:
    """Totals since the relay started."""

    batches: int = 0
    published: int = 0
    refused: int = 0
    parked: int = 0
    unsettled: int = 0
    out_of_order: int = 0
    errors: int = 0
    last_error: str | None = field(default=None)
    #: Rows that failed to publish, by reason: the refusals' kinds ("unroutable", "nacked",
    #: "too_large", "routing_failed", "refused", ...), "no_answer" (the broker did not settle
    #: them) and "unavailable" (the broker could not be reached); each row counts once per failed
    #: attempt.
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str, rows: int = 1) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + rows

    def add(self, report: BatchReport) -> None:
        self.batches += 1
        self.published += report.published
        self.refused += report.refused
        self.parked += report.parked
        self.unsettled += report.unsettled
        self.out_of_order += report.out_of_order


class Relay:
    """Publishes the outbox of ``schema`` in the database ``dsn`` through ``publisher``.

    Run several (in one process or many): they share the rows without double publishing. ``run``
    loops until ``stop`` is set; ``run_once`` does one batch on a connection the caller gives
    (for tests and for embedding in another loop).
    """

    def __init__(
        self,
        dsn: str,
        publisher: Publisher,
        *,
        schema: str = DEFAULT_SCHEMA,
        batch_size: int = DEFAULT_BATCH_SIZE,
        per_aggregate: int = DEFAULT_PER_AGGREGATE,
        concurrency: int = DEFAULT_CONCURRENCY,
        policy: RetryPolicy | None = None,
        poll_interval: timedelta = DEFAULT_POLL_INTERVAL,
        listen: bool = True,
        listen_dsn: str | None = None,
        prepare_threshold: int | None = DEFAULT_PREPARE_THRESHOLD,
        outage_backoff: tuple[timedelta, timedelta] = DEFAULT_OUTAGE_BACKOFF,
    ) -> None:
        # Said here rather than by the loops: a wrong type would otherwise fail every batch
        # (a float batch size is refused by the claim) or escape as a bare TypeError.
        if not isinstance(poll_interval, timedelta) or not (
            timedelta(0) < poll_interval <= MAX_POLL_INTERVAL
        ):
            raise ConfigError(f"poll_interval must be above 0 and at most {MAX_POLL_INTERVAL}")
        for what, count in (
            ("batch_size", batch_size),
            ("per_aggregate", per_aggregate),
            ("concurrency", concurrency),
        ):
            if type(count) is not int or count < 1:
                raise ConfigError(f"{what} must be a whole number of at least 1, not {count!r}")
        low, high = outage_backoff
        if (
            not isinstance(low, timedelta)
            or not isinstance(high, timedelta)
            or not (timedelta(0) < low <= high)
        ):
            raise ConfigError("outage_backoff must be two timedeltas with 0 < first <= second")
        if not isinstance(dsn, str):
            raise ConfigError(f"the relay's dsn must be a str, not {type(dsn).__name__}")
        for what, conninfo in (("dsn", dsn), ("listen_dsn", listen_dsn)):
            _check_conninfo(what, conninfo)
        # A class, or an object without publish() and close(), would fail every batch; a
        # policy of the wrong type only the first refusal, after the batch was published, so
        # that the same rows would go to the broker again at every retry.
        if isinstance(publisher, type) or not all(
            callable(getattr(publisher, method, None)) for method in ("publish", "close")
        ):
            shown = (
                f"the class {publisher.__name__}"
                if isinstance(publisher, type)
                else type(publisher).__name__
            )
            raise ConfigError(
                "the relay's publisher must be a publisher instance (with publish() and "
                f"close()), not {shown}"
            )
        if policy is not None and not isinstance(policy, RetryPolicy):
            raise ConfigError(
                f"the relay's policy must be a RetryPolicy or None, not {type(policy).__name__}"
            )
        self.dsn = dsn
        self.publisher = publisher
        self.store = AsyncOutboxStore(schema=schema)
        self.batch_size = batch_size
        self.per_aggregate = min(per_aggregate, batch_size)
        self.concurrency = concurrency
        self.policy = policy or RetryPolicy()
        self.poll_interval = poll_interval
        self.listen = listen
        #: LISTEN needs a session of its own; behind PgBouncer in transaction mode give the
        #: server's direct address here.
        self.listen_dsn = listen_dsn or dsn
        #: None behind a transaction-mode pooler (PGONCE_POOLER), whatever was given.
        self.prepare_threshold = own_connect_kwargs({"prepare_threshold": prepare_threshold})[
            "prepare_threshold"
        ]
        # With PGONCE_POOLER unset, the first connection says whether psycopg may prepare.
        self._pooler_checked = False
        self.outage_backoff = outage_backoff
        self.stats = RelayStats()
        #: Holds back repeated reports of one row's failure: per (aggregate type, reason).
        self.throttle = Throttle()
        #: The loops' runs of failures, shared by the loops (an outage is one line however many
        #: loops run, and one line when it is over): the database (cannot be reached, or fails
        #: the relay's statements), batches that failed otherwise (a publisher's bug), batches
        #: the broker could not be reached for or did not answer, and the LISTEN connection.
        self._database = FailureRun(
            log,
            "relay: the database answers again (%(count)d failed attempts in a row); the rows that "
            "waited are published now",
        )
        self._batches = FailureRun(log, "relay: batches publish again (%(count)d failed in a row)")
        self._cut_runs = FailureRun(
            log,
            "relay: batches run again, no longer cut by a server-set timeout (%(count)d cut in "
            "a row)",
        )
        self._registering = FailureRun(
            log,
            "relay: registering as a waiting relay works again (%(count)d failed in a row); "
            "notifications wake the relay again",
        )
        publisher_name = str(getattr(publisher, "name", type(publisher).__name__))
        self._broker = FailureRun(
            log,
            f"relay: {publisher_name.replace('%', '%%')} answers again (%(count)d batches in a "
            "row got no answer)",
        )
        self._listener = FailureRun(
            log,
            "relay: LISTEN connection back (%(count)d failures in a row); notifications wake the "
            "relay again",
        )
        #: How long a stop waits for a batch whose rows are at the broker (see
        #: :data:`DEFAULT_STOP_GRACE`).
        self.stop_grace = DEFAULT_STOP_GRACE
        #: What each batch loop's task is doing, for a stop: "claiming" (a statement, nothing at
        #: the broker), "queued" (claimed, waiting for its turn at the broker behind other
        #: batches), "connecting" (waiting for the publisher's connection, nothing at the
        #: broker), "settling" (rows at the broker, that many) or "marking" (answered, the
        #: rows being marked), from run_once().
        self._doing: dict[asyncio.Task[Any], tuple[str, int]] = {}
        #: What a stop cancelled, one per loop: (the task's doing, rows at the broker).
        self._cut: list[tuple[str, int]] = []
        #: Set when run()'s stop is: a claim that ends afterwards publishes nothing.
        self._stopping = False
        #: Whether the publisher is connected, as far as the relay knows: set once its prepare()
        #: connected, cleared by a batch whose answers were lost (the publishers drop the
        #: connection then) and at the end of run(). While it is clear, or while the publisher's
        #: own ``connected`` says its connection closed (see Publisher.connected), a batch
        #: connects first, as "connecting", which a stop cancels at once (see _link());
        #: connected, a batch goes to publish() with no step of its own.
        self._linked = False
        #: Whether the publisher was given the outbox's origin (see _give_origin()).
        self._origin_given = False
        #: Held by the loop that reads it: the others, starting with it, wait for its read.
        self._origin_lock = asyncio.Lock()
        #: Whether the LISTEN connection was seen to receive a notification: checked once.
        self._heard = False
        #: Set when it was seen not to (a transaction-mode pooler): the loops poll, unregistered.
        self._deaf = False
        #: Names this relay in outbox_waiting_relays; unique per instance.
        self.name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._wake = asyncio.Event()
        #: Admits ``concurrency`` batches to the broker at once; set by run() and drain(), whose
        #: loops share it (run_once on a caller's connection publishes without waiting).
        self._at_broker: asyncio.Semaphore | None = None

    async def run_once(
        self, conn: AsyncConnection[Any], *, now: datetime | None = None
    ) -> BatchReport:
        """Claim, publish and settle one batch in one transaction on ``conn`` (autocommit)."""
        task = asyncio.current_task()
        if task is not None:
            # The BEGIN too: on a server that stopped answering, it is what waits.
            self._doing[task] = ("claiming", 0)
        try:
            if not self._origin_given:
                await self._give_origin(conn)
            async with conn.transaction():
                batch = await self.store.claim(
                    conn, limit=self.batch_size, per_aggregate=self.per_aggregate, now=now
                )
                if not batch:
                    return BatchReport()
                if task is not None:
                    # Claimed, waiting for its turn at the broker behind other batches: nothing
                    # sent and no statement in progress; a stop cancels it at once.
                    self._doing[task] = ("queued", 0)
                broker_down = False
                async with self._at_broker or contextlib.nullcontext():
                    if task is not None:
                        del self._doing[task]
                    # From here to the commit a stop lets the batch mark what the broker
                    # acknowledged (for a while: DEFAULT_STOP_GRACE); before, it cancels the
                    # claim outright, as nothing of the batch reached the broker.
                    if self._stopping:
                        # Claimed as the relay was asked to stop: left for the next run (the
                        # commit of the claim alone releases the rows).
                        return BatchReport()
                    try:
                        # A connection the broker closed while the relay was idle (an idle
                        # timeout, a restart, a cut) is seen by the publisher's client, which
                        # says so in ``connected``: the batch connects first, as it does after
                        # a batch that lost its answers. Read, not awaited: nothing is added to
                        # a batch on an open connection.
                        if not self._linked or not getattr(self.publisher, "connected", True):
                            await self._link(task)
                            if self._stopping:
                                # Connected as the relay was asked to stop: nothing was sent.
                                return BatchReport()
                        with self._sending(task, len(batch)):
                            result = await self.publisher.publish(batch)
                        if task is not None:
                            # Answered: what waits now is the database's marking of the rows.
                            self._doing[task] = ("marking", len(batch))
                    except BrokerUnavailable as error:
                        result, broker_down = PublishResult(lost=str(error)), True
                    if result.lost is not None:
                        # The publishers drop a connection that lost answers: the next batch
                        # connects first.
                        self._linked = False
                # The backoff is computed on this host's clock and compared with the database's
                # in the claim; a skew of a few seconds shifts a retry by as much, nothing worse.
                settled_at = now or datetime.now(UTC)
                settlement = settle(batch, result.acked, result.refused)
                await self.store.mark_published(conn, settlement.published, now=now)
                refusals = [
                    refuse(
                        self.policy,
                        id=row.id,
                        attempts_before=row.attempts,
                        error=error,
                        now=settled_at,
                    )
                    for row, error in settlement.refused
                ]
                await self.store.record_refusals(conn, refusals)
        finally:
            if task is not None:
                self._doing.pop(task, None)
        # Reported after the commit: what the log says happened has happened.
        self._report(batch, result, refusals, broker_down, settled_at)
        parked = sum(1 for r in refusals if r.parked_at is not None)
        if settlement.out_of_order:
            log.warning(
                "relay: %d rows acknowledged after an earlier row of their aggregate was refused",
                settlement.out_of_order,
            )
        return BatchReport(
            claimed=len(batch),
            published=len(settlement.published),
            refused=len(refusals) - parked,
            parked=parked,
            unsettled=len(settlement.unsettled),
            out_of_order=settlement.out_of_order,
            broker_down=broker_down,
        )

    async def _give_origin(self, conn: AsyncConnection[Any]) -> None:
        """Give the publisher the outbox's origin (its ``set_origin()``, when it has one), read
        from the database once, before the first batch (see :func:`outbox_origin`)."""
        async with self._origin_lock:
            if not self._origin_given:
                await self._read_origin(conn)

    async def _read_origin(self, conn: AsyncConnection[Any]) -> None:
        set_origin = getattr(self.publisher, "set_origin", None)
        if set_origin is not None:
            with translate_errors("reading the outbox's origin"):
                try:
                    async with conn.transaction():
                        cur = await conn.execute(
                            "SELECT system_identifier::text, current_database()::text"
                            " FROM pg_control_system()"
                        )
                        system_identifier, database = (await cur.fetchall())[0]
                except _NO_CONTROL_DATA as error:
                    # A server that lets no one read its control data: the origin names the
                    # database and the schema only, the same in another cluster's database of
                    # the same name.
                    log.warning(
                        "relay: the cluster's system identifier cannot be read (%s): the message "
                        "ids name the outbox by its database and schema only; give outboxes of "
                        "databases of the same name that publish into one destination a prefix "
                        "each (msg_id_prefix)",
                        str(error).strip().splitlines()[0] if str(error).strip() else error,
                    )
                    async with conn.transaction():
                        cur = await conn.execute("SELECT current_database()::text")
                        system_identifier, database = "", (await cur.fetchall())[0][0]
            set_origin(outbox_origin(system_identifier, database, self.store.schema))
        self._origin_given = True

    async def _link(self, task: asyncio.Task[Any] | None) -> None:
        """Connect the publisher (its prepare(), when it has one) before a batch's rows go out.

        A connect waits for the broker, and a broker that accepts and does not answer holds it
        for the publisher's whole connect timeout; inside publish() the batch would count as at
        the broker, and a stop would wait for it up to the stop grace. Here it is "connecting":
        nothing of the batch reached the broker, and a stop cancels it at once. Raises
        BrokerUnavailable as publish() would.
        """
        prepare = getattr(self.publisher, "prepare", None)
        if prepare is not None:
            if task is not None:
                self._doing[task] = ("connecting", 0)
            await prepare()
        self._linked = True

    def _sending(
        self, task: asyncio.Task[Any] | None, rows: int
    ) -> contextlib.AbstractContextManager[None]:
        """Around a batch's publish(): its ``rows`` count as at the broker ("settling"), which
        a stop gives its grace; for a publisher that says when a row goes out
        (``reports_sending``, see Publisher), only from then: before, the batch is
        "connecting" (a connect inside publish(): to a destination its routing function names,
        or through a proxy), which a stop cancels at once, nothing of it sent."""
        if task is None:
            return contextlib.nullcontext()
        if getattr(self.publisher, "reports_sending", False) is not True:
            self._doing[task] = ("settling", rows)
            return contextlib.nullcontext()
        self._doing[task] = ("connecting", 0)

        def sent() -> None:
            # Only from "connecting": a late signal must not take back "marking".
            if self._doing.get(task, ("", 0))[0] == "connecting":
                self._doing[task] = ("settling", rows)

        return on_sending(sent)

    def _report(
        self,
        batch: list[OutboxMessage],
        result: PublishResult,
        refusals: list[Refusal],
        broker_down: bool,
        now: datetime,
    ) -> None:
        """Log each kind of failure of a batch once (then throttled) and count every row of it."""
        publisher = self.publisher.name
        rows = {row.id: row for row in batch}
        for refusal in refusals:
            row = rows[refusal.id]
            kind = result.kinds.get(refusal.id, "refused")
            self.stats.fail(kind)
            if refusal.parked_at is not None:
                next_step = (
                    f"parked after {refusal.attempts} attempts; replay it with "
                    f"`pgonce replay --outbox --id {refusal.id}` once the cause is fixed"
                )
            else:
                next_step = (
                    f"attempt {refusal.attempts} of {self.policy.max_attempts}, "
                    f"retry at {refusal.next_attempt_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z"
                )
            held = self.throttle.admit((row.aggregatetype, kind, refusal.parked_at is None), now)
            if held is not None:
                (log.error if refusal.parked_at else log.warning)(
                    "relay: %s %s outbox row %d (aggregate %s/%s, event %s): %s; %s%s",
                    publisher,
                    kind,
                    row.id,
                    row.aggregatetype,
                    row.aggregateid,
                    row.type,
                    refusal.last_error,
                    next_step,
                    held_back(held),
                )
        answered = result.acked.union(result.refused)
        if answered:
            # The broker answered: an outage of it, or a run of batches it left unanswered, ends.
            self._broker.succeeded()
        unanswered = [row for row in batch if row.id not in answered]
        if unanswered and result.refused:
            # The rows behind a refused row of their aggregate wait for it, to keep the order:
            # they were not left without an answer, and saying so would send one looking for an
            # outage.
            behind: set[tuple[str, str]] = set()
            unanswered = []
            for row in batch:
                aggregate = (row.aggregatetype, row.aggregateid)
                if row.id in result.refused:
                    behind.add(aggregate)
                elif row.id not in answered and aggregate not in behind:
                    unanswered.append(row)
        if not unanswered:
            return
        reason = "unavailable" if broker_down else "no_answer"
        self.stats.fail(reason, len(unanswered))
        types = sorted({row.aggregatetype for row in unanswered})
        fields = {
            "publisher": publisher,
            "what": "is unavailable" if broker_down else "gave no answer",
            "rows": len(unanswered),
            "types": ", ".join(types[:5]) + (", ..." if len(types) > 5 else ""),
            "lost": result.lost or "the outcome is unknown",
            "backoff": self.outage_backoff[1].total_seconds(),
        }
        first = (
            "relay: %(publisher)s %(what)s for %(rows)d outbox rows (aggregate types %(types)s): "
            "%(lost)s; they wait without an attempt counted and are published again after a "
            "backoff of at most %(backoff)g s"
        )
        if answered:
            # Part of the batch was answered: the broker is there, these rows' answers were lost.
            held = self.throttle.admit(("*", reason), now)
            if held is not None:
                log.warning(first + "%(held)s", {**fields, "held": held_back(held)})
            return
        self._broker.failed(
            BrokerUnavailable(str(fields["lost"])),
            first,
            "relay: %(publisher)s still %(what)s (%(count)d batches in a row): %(lost)s",
            fields,
        )

    async def run(self, stop: asyncio.Event | None = None) -> RelayStats:
        """Publish until ``stop`` is set (forever without one); survive database and broker
        outages by waiting and reconnecting. ``concurrency`` batches are at the broker at once;
        :data:`LOOPS_PER_BATCH_IN_FLIGHT` batch loops per batch in flight run, each on its own
        connection, sharing the publisher and the LISTEN connection."""
        stop = stop or asyncio.Event()
        log.info(
            "relay: publishing the outbox of schema %s through %s",
            self.store.schema,
            self.publisher.name,
        )
        # A publisher that can check its destination does it now: what is wrong is said at the
        # start, not with the first row. The rows wait meanwhile; the loops retry.
        prepare = getattr(self.publisher, "prepare", None)
        if prepare is not None:
            # A stop does not wait for it: a broker that accepts and does not answer holds the
            # check for the publisher's whole connect timeout, and no row is in flight yet.
            try:
                finished, _ = await self._unless_stopped(prepare(), stop, cut=False)
            except BrokerUnavailable as error:
                # The outage's first report: the batches that find the broker away next are
                # the same outage, counted on, and its end is said once.
                self._broker.failed(
                    error,
                    "relay: %(publisher)s is unavailable for the outbox rows at the start: "
                    "%(error)s; the rows wait until it is fixed, without an attempt counted, "
                    "and a line says when it answers",
                    "relay: %(publisher)s still unavailable (%(count)d in a row): %(error)s",
                    {"publisher": self.publisher.name},
                )
            else:
                if not finished:
                    await self.publisher.close()
                    return self.stats
                self._linked = True
        listener = asyncio.create_task(self._listen(stop)) if self.listen else None
        self._cut = []
        self._stopping = False
        try:
            await self._batch_loops(lambda n: self._loop(stop, f"{self.name}/{n}"))
            self._report_cut()
        finally:
            self._stopping = False
            if listener is not None:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
            await self.publisher.close()
            self._linked = False
        return self.stats

    async def _loop(self, stop: asyncio.Event, name: str) -> None:
        outage = self.outage_backoff[0]
        conn: AsyncConnection[Any] | None = None
        try:
            while not stop.is_set():
                try:
                    if conn is None or conn.closed:
                        conn = await self._connect_unless_stopped(stop)
                        if conn is None:
                            return
                    # Cleared before the claim: a notification arriving during the batch is
                    # kept for the next wait.
                    self._wake.clear()
                    finished, report = await self._unless_stopped(self.run_once(conn), stop)
                    if not finished or report is None:
                        return
                    self.stats.add(report)
                    self._database.succeeded()
                    self._cut_runs.succeeded()
                    if report.claimed:
                        # A loop that found no rows says nothing of a publisher that fails.
                        self._batches.succeeded()
                    if report.broker_down or (report.unsettled and not report.published):
                        await self._sleep(stop, _jittered(outage), wake=False)
                        outage = min(outage * 2, self.outage_backoff[1])
                        continue
                    outage = self.outage_backoff[0]
                    if report.claimed < self.batch_size:
                        # Inside the try: registering as waiting talks to the database too, and a
                        # failure there must cost a reconnect, not the relay.
                        finished, _ = await self._unless_stopped(
                            self._wait_for_rows(conn, stop, name), stop
                        )
                        if not finished:
                            return
                except Exception as raised:
                    # The loop outlives any one failure: a database outage (PgonceError) or a
                    # bug in a publisher. Rows of the failed batch were not marked; they wait.
                    # A registration as waiting runs between batches: no rows are involved.
                    registering = isinstance(raised, _NotRegistered)
                    if isinstance(raised, _NotRegistered):
                        raised = raised.error
                    error = translated(raised, "beginning a batch of outbox rows")
                    self.stats.errors += 1
                    self.stats.last_error = str(error)
                    # Once per run of failures (a down database fails every loop at every
                    # retry), saying what happens next; once more when batches run again.
                    again = f"the loop reconnects and tries again in {outage.total_seconds():g} s"
                    fields = {
                        "next": f"no batch was in progress; {again}, with a batch first, so "
                        "rows are still published, found without notifications meanwhile"
                        if registering
                        else f"the batch's rows were not marked and wait; {again}",
                    }
                    if registering and not isinstance(error, DatabaseUnavailable):
                        # A refusal of the registration alone: the batches between succeed,
                        # which must not end (and so repeat) the run of this one's failures.
                        self._registering.failed(
                            error,
                            "relay: %(error)s; %(next)s",
                            "relay: registering as a waiting relay still fails (%(count)d in a "
                            "row): %(error)s",
                            fields,
                        )
                    elif (setting := cut_by(error)) is not None:
                        # A statement the server's own timeout cut: the connection is fine, the
                        # database is not away.
                        values = (
                            {} if self._cut_runs.in_a_row else await server_setting(conn, setting)
                        )
                        value = values.get(setting)
                        self._cut_runs.failed(
                            error,
                            "relay: %(error)s: the statement was cut by the server's "
                            "%(setting)s%(shown)s, not by a lost connection; it is likely set "
                            "on the database or the role (ALTER DATABASE or ALTER ROLE ... SET "
                            "%(setting)s) or in the dsn's options; %(what)s rolled back and "
                            "retried in %(delay)g s, its rows stay pending, and the relay says "
                            "so when batches run again",
                            "relay: statements still cut by %(setting)s (%(count)d in a row): "
                            "%(error)s",
                            {
                                "setting": setting,
                                "shown": f" ({value})" if value else "",
                                "what": "the registration as waiting is"
                                if registering
                                else "the batch is",
                                "delay": outage.total_seconds(),
                            },
                        )
                    elif isinstance(error, DatabaseError | psycopg.OperationalError):
                        self._database.failed(
                            error,
                            "relay: %(error)s; %(next)s",
                            "relay: the database still fails (%(count)d in a row): %(error)s",
                            fields,
                        )
                    elif isinstance(error, PgonceError):
                        self._batches.failed(
                            error,
                            "relay: %(error)s; %(next)s",
                            "relay: batches still fail (%(count)d in a row): %(error)s",
                            fields,
                        )
                    else:
                        self._batches.failed(
                            error,
                            "relay: a batch failed; %(next)s",
                            "relay: batches still fail (%(count)d in a row): %(type)s: %(error)s",
                            fields,
                            level=logging.ERROR,
                            exc_info=True,
                        )
                    if conn is not None:
                        await conn.close()
                    conn = None
                    await self._sleep(stop, outage, wake=False)
                    outage = min(outage * 2, self.outage_backoff[1])
        finally:
            if conn is not None:
                await conn.close()

    async def _unless_stopped(
        self, work: Awaitable[_T], stop: asyncio.Event, *, cut: bool = True
    ) -> tuple[bool, _T | None]:
        """``work`` (a batch, or the wait for rows) until done; ``(False, None)`` when ``stop``
        ended it first.

        A stop used to wait for the batch's statement, and a statement can wait for good: on a
        lock another session holds, or on a server that stopped answering. Now a batch at the
        broker gets :attr:`stop_grace` to mark what the broker acknowledged; anything else (a
        claim, which then publishes nothing, or the wait for rows, which ends by itself at a
        stop) :data:`STOP_WAIT`. Cancelled, psycopg cancels the statement on the server (and
        gives up on a server that does not answer after a few seconds), the transaction rolls
        back and the rows wait for the next run, which publishes those of a batch at the broker
        again, with the same message ids. Without ``cut`` (work no row depends on: the
        publisher's check at the start), ``work`` is cancelled at once, and nothing is said; so
        is a claimed batch waiting for its turn at the broker or for the publisher's connection
        (nothing of it was sent, and no database statement is in progress), whose rows wait for
        the next run.
        """
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and cut:
                self._stopping = True
                doing, _ = self._doing.get(task, ("", 0))
                if doing not in _NOTHING_SENT:
                    grace = self.stop_grace if doing in _AT_BROKER else STOP_WAIT
                    await asyncio.wait({task}, timeout=grace.total_seconds())
            if task.done():
                return True, task.result()
            doing_then = self._doing.get(task, ("waiting", 0))
            task.cancel()
            # Not awaited directly: a cancellation of this task must still propagate.
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: the stop is what is said about it
            if cut and doing_then[0] not in _NOTHING_SENT:
                self._cut.append(doing_then)
            return False, None
        finally:
            stopping.cancel()
            if not task.done():
                # This loop was cancelled itself: so is its batch, and it is waited for.
                task.cancel()
                await asyncio.wait({task})

    def _report_cut(self) -> None:
        """One line for what a stop cancelled, if anything: which statements, and where the
        rows of the batches are."""
        if not self._cut:
            return
        claiming = sum(1 for doing, _ in self._cut if doing == "claiming")
        settling = [rows for doing, rows in self._cut if doing in _AT_BROKER]
        marking = sum(1 for doing, _ in self._cut if doing == "marking")
        other = len(self._cut) - claiming - len(settling)
        what = []
        if claiming:
            what.append(
                f"{claiming} claim(s) of a batch, not done within "
                f"{STOP_WAIT.total_seconds():g} s, before anything was published"
            )
        if settling:
            what.append(
                f"{len(settling)} batch(es) at the broker, not settled within "
                f"{self.stop_grace.total_seconds():g} s: their {sum(settling)} rows were not "
                "marked and are published again by the next run, with the same message ids"
            )
        if other:
            what.append(
                f"{other} registration(s) as a waiting relay, not done within "
                f"{STOP_WAIT.total_seconds():g} s"
            )
        if claiming or other or marking:
            log.warning(
                "relay: stopping without waiting for database statements that did not finish "
                "(a lock another session holds, or a server that does not answer): cancelled "
                "%s; the rows of a cancelled batch wait for the next run",
                "; ".join(what),
            )
        else:
            # Only batches the broker had not answered: no database statement was cut.
            log.warning(
                "relay: stopping without waiting for the broker's answers: cancelled %s; "
                "their rows stay pending and are sent again by the next relay",
                "; ".join(what),
            )

    async def _connect_unless_stopped(self, stop: asyncio.Event) -> AsyncConnection[Any] | None:
        """A connection to the relay's database, or None once ``stop`` is set.

        A server that accepts and does not answer (stalled, or a pooler with a full pool) holds
        a connect for libpq's whole timeout; no batch is in progress, so a stop need not wait.
        """
        connecting = asyncio.ensure_future(self.connect(self.dsn))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not connecting.done():
            connecting.cancel()
            # Not awaited directly: a cancellation of this task must still propagate.
            await asyncio.wait({connecting})
            if connecting.cancelled() or connecting.exception() is not None:
                return None
            # Connected just as it was given up.
            await connecting.result().close()
            return None
        return connecting.result()

    async def _wait_for_rows(
        self, conn: AsyncConnection[Any], stop: asyncio.Event, name: str
    ) -> None:
        """Sleep until a notification, ``stop`` or the poll interval.

        Without listening this is a plain poll. With it, the loop first registers as waiting
        (from then on enqueue() notifies) and looks once more, because a row committed just
        before the registration sent no notification. A transaction that checked the
        registration before it existed and commits after the last look is the one case left to
        the poll.
        """
        if not self.listen or self._deaf:
            await self._sleep(stop, self.poll_interval, wake=True)
            return
        try:
            await self.store.set_waiting(conn, name, True)
        except Exception as error:
            raise _NotRegistered(error) from error
        self._registering.succeeded()
        waited = False
        try:
            report = await self.run_once(conn)
            self.stats.add(report)
            if not report.claimed:
                await self._sleep(stop, self.poll_interval, wake=True)
            waited = True
        finally:
            try:
                await self.store.set_waiting(conn, name, False)
            except Exception as error:
                if waited:
                    raise _NotRegistered(error) from error
                # Otherwise the batch's failure (or the stop) is what is said.

    async def drain(self, *, now: datetime | None = None) -> RelayStats:
        """Run batches until nothing is claimable, with the loops of :meth:`run`; for scripts,
        tests and the benchmark. A batch with unsettled rows ends its loop too (they are due
        again at once). The publisher stays open."""
        stats = RelayStats()

        async def loop() -> None:
            conn = await self.connect(self.dsn)
            try:
                while True:
                    report = await self.run_once(conn, now=now)
                    stats.add(report)
                    if not report.claimed or report.unsettled or report.broker_down:
                        return
            finally:
                await conn.close()

        await self._batch_loops(lambda _: loop())
        return stats

    async def _batch_loops(self, loop: Callable[[int], Awaitable[None]]) -> None:
        """Run :data:`LOOPS_PER_BATCH_IN_FLIGHT` batch loops per batch in flight (``loop(n)``
        for each), with ``concurrency`` batches at the broker at once, until all have ended."""
        self._at_broker = asyncio.Semaphore(self.concurrency)
        try:
            await asyncio.gather(
                *(loop(n) for n in range(self.concurrency * LOOPS_PER_BATCH_IN_FLIGHT))
            )
        finally:
            self._at_broker = None

    def wake(self) -> None:
        """Make a waiting :meth:`run` look for rows now (what a notification does)."""
        self._wake.set()

    async def connect(self, dsn: str) -> AsyncConnection[Any]:
        with translate_errors("connecting the outbox relay"):
            conn = await AsyncConnection.connect(
                dsn, autocommit=True, prepare_threshold=self.prepare_threshold
            )
            if not self._pooler_checked and dsn == self.dsn:  # not the LISTEN address
                try:
                    self.prepare_threshold = await own_prepare_threshold(conn, "the outbox relay")
                except BaseException:
                    await conn.close()
                    raise
                self._pooler_checked = True
            return conn

    async def _sleep(self, stop: asyncio.Event, delay: timedelta, *, wake: bool) -> None:
        events = [stop, self._wake] if wake else [stop]
        waiters = [asyncio.create_task(e.wait()) for e in events]
        try:
            await asyncio.wait(
                waiters, timeout=delay.total_seconds(), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _listen(self, stop: asyncio.Event) -> None:
        """Set the wake event on every notification; reconnect after a failure (polling covers
        the gap)."""
        while not stop.is_set():
            try:
                async with self._listening() as notifications:
                    if notifications is None:
                        self._deaf = True
                        log.warning(
                            "relay: the LISTEN connection (%s) received no notification within "
                            "%g s of one sent to it: a transaction-mode pooler between it and "
                            "the server delivers none. The relay polls every %g s instead, and "
                            "no longer asks enqueue() to notify; give listen_dsn "
                            "(PGONCE_LISTEN_DSN for the service) a direct connection to the "
                            "server to be woken within milliseconds",
                            describe_dsn(self.listen_dsn),
                            LISTEN_CHECK.total_seconds(),
                            self.poll_interval.total_seconds(),
                        )
                        return
                    self._listener.succeeded()
                    # A row may have committed while we were not listening.
                    self._wake.set()
                    async for _ in notifications:
                        self._wake.set()
            except (PgonceError, psycopg.Error) as error:
                # Once per run of failures: a database that stays down fails every reconnect.
                self._listener.failed(
                    error,
                    "relay: LISTEN connection lost (%(error)s); polling every %(poll)g s "
                    "meanwhile and reconnecting",
                    "relay: LISTEN connection still lost (%(count)d failures in a row): %(error)s",
                    {"poll": self.poll_interval.total_seconds()},
                    level=logging.INFO,
                )
            await self._sleep(stop, self.poll_interval, wake=False)

    @contextlib.asynccontextmanager
    async def _listening(self) -> AsyncIterator[AsyncIterator[object] | None]:
        """The notifications of a new LISTEN connection; None when a notification sent to it did
        not arrive (checked on the first connection that listens)."""
        conn = await self.connect(self.listen_dsn)
        try:
            await self.store.listen(conn)
            if not self._heard:
                if not await self._hears(conn):
                    yield None
                    return
                self._heard = True
            yield conn.notifies()
        finally:
            await conn.close()

    async def _hears(self, conn: AsyncConnection[Any]) -> bool:
        """Whether ``conn``, listening, receives a notification sent from another connection
        (see :func:`pgonce.store._async.notify.hears`): through a transaction-mode pooler the
        relay would wait for none, and make every enqueue() notify for nothing."""
        sender = await self.connect(self.listen_dsn)
        try:
            return await hears(conn, sender, self.store.channel, within=LISTEN_CHECK)
        finally:
            await sender.close()


class _NotRegistered(Exception):
    """Carries the failure of a loop's registration as a waiting relay (or of its end) out of
    the wait for rows: a step between batches, in which no rows are involved."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _check_conninfo(what: str, conninfo: str | None) -> None:
    """Refuse a connection string libpq cannot parse, now and without quoting it: libpq's own
    message repeats the text (``missing "=" after "postgres//user:password@..."``), which the
    relay would log, password and all, at every reconnect."""
    if conninfo is None:
        return
    if not isinstance(conninfo, str):
        raise ConfigError(f"the relay's {what} must be a str, not {type(conninfo).__name__}")
    try:
        conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        raise ConfigError(
            f"the relay's {what} is not a connection string PostgreSQL can read (a URI such as "
            "postgresql://user@host/db, or key=value pairs); it is not repeated here because "
            "it may hold a password"
        ) from None


def _jittered(delay: timedelta) -> timedelta:
    return delay * random.uniform(0.8, 1.2)
