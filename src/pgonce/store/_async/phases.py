"""Two-phase keys on an async psycopg connection: leases, fencing tokens and recovery points.

For a request that must call a third party and answer with its result, which no single
transaction can hold. The claim commits at once with a lease and a fencing token; each phase of
the request is then a short transaction of its own that records the point reached together with
the phase's own writes; the last one stores the response. A retry (or the completer) takes over a
key whose lease ran out, with a larger token, and resumes after the last recorded point; every
write of the old holder names its token and is refused from then on (:class:`LeaseLost`).

pgonce owns these transactions: the connection must be idle (outside a transaction), as for
``begin()``. This file is the source of ``_sync/phases.py`` (``tools/gen_sync.py``); edit this one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb

from pgonce.config import DEFAULT_CLAIM_WAIT, DEFAULT_RETRY_AFTER, DEFAULT_SCHEMA
from pgonce.core.checks import (
    check_connection,
    check_duration,
    check_int,
    check_optional_time,
    check_str,
    check_strs,
    describe,
)
from pgonce.core.leases import (
    DEFAULT_LEASE,
    Abandoned,
    CompleterPass,
    check_heartbeat,
    check_lease,
    check_phase,
    check_retire_after,
    check_state,
    failure_note,
    not_stored_note,
    provider_key,
    retired_response,
)
from pgonce.core.outage import FailureRun
from pgonce.core.outcomes import (
    TOO_MANY_REQUESTS,
    Claim,
    ClaimRow,
    InFlight,
    Replay,
    Response,
    Won,
    decide,
    validate_fingerprint,
    validate_key,
    validate_response,
)
from pgonce.errors import DatabaseError, LeaseLost, UsageError
from pgonce.sql import Queries
from pgonce.store._async.sweeper import StopSignal, _wait
from pgonce.store.common import check_key_settings
from pgonce.store.cursors import cursor
from pgonce.store.errors import translate_errors
from pgonce.store.heartbeat import AsyncCallback, AsyncHeartbeat

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger("pgonce.completer")

#: How often the completer looks for abandoned requests. A request is abandoned only once its
#: lease ran out (30 s by default), so looking more often than every few seconds finds nothing new.
DEFAULT_COMPLETE_EVERY = timedelta(seconds=5)
#: Requests claimed longer ago than this are left to a person (the health check shows them): a
#: client has long given up on an answer, and finishing a day-old payment surprises everyone.
DEFAULT_COMPLETE_MAX_AGE = timedelta(hours=1)
#: Holders that failed before the completer retires a request with a stored problem answer: a
#: provider outage of a few minutes is ridden out, a request that can never succeed is not
#: retried forever.
DEFAULT_RETIRE_AFTER = 5

#: Why a second write of one holder is refused while one runs.
_BUSY = (
    "a two-phase operation runs one phase, call or write at a time: a phase inside a phase, or "
    "two at once (tasks gathered, threads), would share one connection and record stale "
    "state; run them one after the other"
)

#: Why a call's record (or a renewal while it runs) is refused on a connection its work used.
_USED = (
    "a call's work must not use the operation's connection: it left a transaction open on it, "
    "in which the call's record would not commit; nothing was recorded"
)

#: The longest ``max_age``: no request waits a millennium for its completer, and far longer
#: ones reach back before PostgreSQL's first timestamp (4713 BC).
_MAX_AGE_LIMIT = timedelta(days=365_000)

#: The largest page of abandoned requests PostgreSQL's LIMIT takes.
_MAX_LIMIT = 2**63 - 1

Row = TypeVar("Row")
#: What a phase returns: recorded as JSON, and read back from it when a retry skips the phase.
Value = TypeVar("Value")

#: The registered work of a resumable request: runs its phases on the operation, returns the answer.
Work = Callable[["AsyncPhasedOperation[Any]"], Awaitable[Response]]


class AsyncPhaseStore:
    """Two-phase claims of keys in pgonce's ``keys`` table, with their leases in ``key_leases``.

    ``lease`` is how long a holder owns its key without a heartbeat; each phase's record renews
    it, and while a third party's call runs (:meth:`AsyncPhasedOperation.call`) a heartbeat
    renews it every ``heartbeat`` (a third of the lease by default). ``wait`` bounds the claim's
    wait for a concurrent one-transaction claim of the same key.
    ``retry_after`` and ``store_server_errors`` are as for :class:`AsyncKeyStore`: a 5xx answer is
    not stored by default, and the key is handed on from its recovery point instead.
    """

    def __init__(
        self,
        *,
        schema: str = DEFAULT_SCHEMA,
        lease: timedelta = DEFAULT_LEASE,
        wait: timedelta = DEFAULT_CLAIM_WAIT,
        retry_after: int = DEFAULT_RETRY_AFTER,
        store_server_errors: bool = False,
        heartbeat: timedelta | None = None,
    ) -> None:
        wait_ms = check_key_settings(
            schema=schema,
            wait=wait,
            retry_after=retry_after,
            store_server_errors=store_server_errors,
        )
        self.schema = schema
        self.lease = check_lease(lease)
        self.heartbeat = check_heartbeat(heartbeat, self.lease)
        self.wait = wait
        self.retry_after = retry_after
        self.store_server_errors = store_server_errors
        self._sql = Queries("phases", schema)
        self._wait_ms = str(wait_ms)

    def stores(self, response: Response) -> bool:
        """Whether ``response`` is kept for replays (a 5xx is not, unless configured; a 429
        never is)."""
        return self.stores_status(response.status)

    def stores_status(self, status: int | None) -> bool:
        """Whether a response with ``status`` is kept for replays.

        A 429 never is: the provider (or a rate limiter) refused the work for now, and a kept
        429 would answer every retry with it for as long as the key is kept; as a 5xx, the
        lease ends and the next retry (or completer pass) resumes from the recovery point.
        """
        if status is None:
            return True
        if status < 500:
            return status != TOO_MANY_REQUESTS
        return self.store_server_errors

    async def start(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        fingerprint: bytes,
        *,
        operation: str | None = None,
        args: Any = None,
        now: datetime | None = None,
    ) -> AsyncPhasedOperation[Row]:
        """Claim ``(scope, key)`` in two-phase mode, or take over its expired lease.

        The claim commits before this returns: the keys row and its lease, with a new fencing
        token. The operation that comes back has :attr:`~AsyncPhasedOperation.claim`:
        :class:`Won` (run the phases; a key taken over resumes after its recorded point, with
        :attr:`~AsyncPhasedOperation.resumed` true), :class:`Replay` (the stored answer) or
        :class:`InFlight` (another holder's lease still runs, or a one-transaction claim holds
        the key). A different request with the same key raises
        :class:`~pgonce.errors.KeyMismatch`.

        ``operation`` names the registered work the completer runs to finish the request if
        every client gives up on it, and ``args`` (JSON) is what that work reads.
        """
        self._check_idle(conn)
        validate_key(scope, key)
        validate_fingerprint(fingerprint)
        check_optional_time(now)
        if operation is not None:
            check_str(operation, "the operation")
        check_state(args, "the request's args")
        params = {
            "scope": scope,
            "key": key,
            "fingerprint": fingerprint,
            "now": now,
            "lease": self.lease,
            "wait_ms": self._wait_ms,
            "operation": operation,
            "args": Jsonb(args),
            "state": Jsonb({}),
            "max_age": None,
        }
        op = AsyncPhasedOperation(self, conn, scope, key)
        with translate_errors("claiming a two-phase key"):
            try:
                async with conn.transaction():
                    cur = cursor(conn)
                    await cur.execute(self._sql.claim, params)
                    won = await cur.fetchone()
                    if won is None:
                        await cur.execute(self._sql.take_over, params)
                        row = await cur.fetchone()
            except psycopg.errors.LockNotAvailable:
                # A one-transaction claim of the key is still open past the wait.
                op.claim = InFlight(retry_after=self.retry_after, reason="locked")
                return op
        if won is not None:
            op._hold(Won(scope, key, fingerprint, won[1]), won[0], None, {}, args, 1)
            return op
        assert row is not None
        op.claim = claim = self._decided(row, scope, key, fingerprint)
        if isinstance(claim, Won):
            op._hold(claim, *_taken(row))
            op.resumed = True
        elif isinstance(claim, Replay):
            op.response = claim.response
        return op

    async def resume(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        key: str,
        *,
        max_age: timedelta | None = None,
        now: datetime | None = None,
    ) -> AsyncPhasedOperation[Row]:
        """Take over ``(scope, key)`` whatever its request, if its lease has expired.

        The completer's takeover: it knows the key, not the request. ``max_age`` leaves alone a
        request claimed longer ago than that. :attr:`~AsyncPhasedOperation.won` is false when
        there was nothing to take over (finished, still leased, too old, gone).
        """
        self._check_idle(conn)
        validate_key(scope, key)
        check_optional_time(now)
        if max_age is not None:
            _check_max_age(max_age)
        params = {
            "scope": scope,
            "key": key,
            "fingerprint": None,
            "now": now,
            "lease": self.lease,
            "max_age": max_age,
        }
        op = AsyncPhasedOperation(self, conn, scope, key)
        with translate_errors("taking over a two-phase key"):
            try:
                async with conn.transaction():
                    cur = cursor(conn)
                    await cur.execute(self._sql.bound_wait, {"wait_ms": self._wait_ms})
                    await cur.execute(self._sql.take_over, params)
                    row = await cur.fetchone()
            except psycopg.errors.LockNotAvailable:
                op.claim = InFlight(retry_after=self.retry_after, reason="locked")
                return op
        assert row is not None
        if row[6] is None:
            op.claim = InFlight(retry_after=self.retry_after, reason="leased")
            return op
        op._hold(Won(scope, key, bytes(row[0]), row[1]), *_taken(row))
        op.resumed = True
        return op

    async def abandoned(
        self,
        conn: AsyncConnection[Row],
        *,
        limit: int = 100,
        operations: Iterable[str] | None = None,
        max_age: timedelta | None = None,
        now: datetime | None = None,
    ) -> list[Abandoned]:
        """Up to ``limit`` requests of a registered operation whose lease has expired.

        Only of the ``operations`` named (None: any), and claimed no longer than ``max_age`` ago
        (None: whenever): what the completer would leave alone must not take its page.
        """
        check_int(limit, "limit")
        if limit > _MAX_LIMIT:
            raise UsageError(f"limit must be at most {_MAX_LIMIT} (a bigint), not {limit}")
        check_optional_time(now)
        if max_age is not None:
            _check_max_age(max_age)
        names = None if operations is None else check_strs(operations, "operations")
        self._check_idle(conn)
        params = {"now": now, "limit": limit, "operations": names, "max_age": max_age}
        # A transaction of its own, ended here: the takeovers that follow need an idle
        # connection, whether or not it is in autocommit.
        with translate_errors("reading abandoned two-phase keys"):
            async with conn.transaction():
                cur = await cursor(conn).execute(self._sql.abandoned, params)
                rows = await cur.fetchall()
        return [Abandoned(*row) for row in rows]

    async def complete(
        self,
        conn: AsyncConnection[Row],
        operations: Mapping[str, Work],
        *,
        limit: int = 100,
        max_age: timedelta | None = DEFAULT_COMPLETE_MAX_AGE,
        retire_after: int = DEFAULT_RETIRE_AFTER,
        now: datetime | None = None,
    ) -> CompleterPass:
        """One pass of the completer: finish abandoned requests from their recovery point.

        ``operations`` maps an operation's name (``start(operation=...)``) to its registered
        work; a request of an operation not in it is left alone. A request whose holders
        failed ``retire_after`` times is retired instead (:meth:`AsyncPhasedOperation.retire`):
        a problem answer (500) is stored, every retry replays it, and health counts it. A
        request claimed more than ``max_age`` ago is left to the health check's stuck phases.
        """
        check_retire_after(retire_after)
        _check_operations(operations)
        done = CompleterPass()
        found = await self.abandoned(
            conn, limit=limit, operations=list(operations), max_age=max_age, now=now
        )
        for item in found:
            work = operations.get(item.operation)
            if work is None:
                continue
            op = await self.resume(conn, item.scope, item.key, max_age=max_age, now=now)
            if not op.won:
                continue
            if op.attempts > retire_after:
                await op.retire(now=now)
                done.retired += 1
                continue
            try:
                response = await op.run(work, now=now)
            except LeaseLost:
                continue
            except Exception as error:  # the work failed: recorded, tried again next pass
                done.failed += 1
                done.errors.append(f"{item.scope}/{item.key}: {failure_note(error)}")
                continue
            if not op.stored:  # a 5xx answer, not stored: the lease ended, tried again next pass
                done.failed += 1
                done.errors.append(f"{item.scope}/{item.key}: {not_stored_note(response.status)}")
                continue
            done.finished += 1
        return done

    def _check_idle(self, conn: AsyncConnection[Row]) -> None:
        check_connection(conn, AsyncConnection, self)
        if conn.info.transaction_status != TransactionStatus.IDLE:
            raise UsageError(
                "a two-phase key commits each phase in a transaction of its own: it needs an "
                "idle connection, outside a transaction"
            )

    def _decided(self, row: tuple[Any, ...], scope: str, key: str, fingerprint: bytes) -> Claim:
        if row[6] is not None:  # the lease was taken over: the request is the same, unfinished
            return Won(scope, key, fingerprint, row[1])
        if row[0] is None:  # the key went again between the claim and this read
            return InFlight(retry_after=self.retry_after, reason="gone")
        claim = decide(
            ClaimRow("existing", *row[:6]),
            scope=scope,
            key=key,
            fingerprint=fingerprint,
            retry_after=self.retry_after,
        )
        if isinstance(claim, InFlight):
            return InFlight(retry_after=self.retry_after, reason="leased")
        return claim


async def complete_every(
    pool: AsyncConnectionPool[Any],
    store: AsyncPhaseStore,
    operations: Mapping[str, Work],
    stop: StopSignal,
    *,
    every: timedelta = DEFAULT_COMPLETE_EVERY,
    max_age: timedelta | None = DEFAULT_COMPLETE_MAX_AGE,
    retire_after: int = DEFAULT_RETIRE_AFTER,
    on_run: Callable[[CompleterPass], None] | None = None,
    on_failure: Callable[[Exception], None] | None = None,
) -> None:
    """The in-process completer: a pass now, then one every ``every``, until ``stop`` is set.

    A pass takes a connection from ``pool`` and gives it back when done. A pass that fails on
    the database (or finds the pool busy for its whole timeout) is tried again at the next tick:
    the first failure of a run of them is logged as a warning, the others at debug level, and
    the pass that succeeds again once more; ``on_failure`` is called with each failed pass's
    error (metrics). A request whose work fails is logged once per failure, and its lease ended
    so that the next pass resumes it.
    """
    # All before the first pass: with the database away at the start, a pass fails as an outage
    # and is retried, and a wrong argument would surface only once the database came back.
    if check_duration(every, "the completer's interval") <= timedelta(0):
        raise UsageError("the completer's interval must be positive")
    if max_age is not None:
        _check_max_age(max_age)
    check_retire_after(retire_after)
    _check_operations(operations)
    if on_run is not None and not callable(on_run):
        raise UsageError(
            f"on_run must be a function that takes the pass's result, not {describe(on_run)}"
        )
    if on_failure is not None and not callable(on_failure):
        raise UsageError(
            f"on_failure must be a function that takes the pass's error, not {describe(on_failure)}"
        )
    failures = FailureRun(
        log, "completer pass succeeded again after %(count)d failures", on_failure
    )
    while not stop.is_set():
        try:
            async with pool.connection() as conn:
                done = await store.complete(
                    conn, operations, max_age=max_age, retire_after=retire_after
                )
        # psycopg's own errors too: the pool's timeout (PoolTimeout) and a connection that
        # breaks while the pool hands it over are raised by the pool, untranslated.
        except (DatabaseError, psycopg.Error) as error:
            failures.failed(
                error,
                "completer pass failed (%(type)s: %(error)s); it tries again every %(every)s",
                "completer pass failed again (%(count)d in a row): %(error)s",
                {"every": every},
            )
        else:
            failures.succeeded()
            for line in done.errors:
                log.warning("abandoned request failed again, retried in %s: %s", every, line)
            if done.finished or done.retired:
                log.info(
                    "completer: %d finished, %d retired, %d failed",
                    done.finished,
                    done.retired,
                    done.failed,
                )
            if on_run is not None:
                on_run(done)
        await _wait(stop, every)


class AsyncPhasedOperation(Generic[Row]):
    """One two-phase request: its claim, its fencing token and the phases it has passed.

    ``state`` maps each phase passed to what it returned. Every write names :attr:`token` and
    raises :class:`~pgonce.errors.LeaseLost`, having written nothing, once the key was taken
    over by a larger one.
    """

    def __init__(
        self, store: AsyncPhaseStore, conn: AsyncConnection[Row], scope: str, key: str
    ) -> None:
        self._store = store
        self._conn = conn
        self.scope = scope
        self.key = key
        self.claim: Claim = InFlight(retry_after=store.retry_after, reason="leased")
        #: The fencing token of this holder (0 when it holds nothing).
        self.token = 0
        #: The last recovery point reached (None: none yet).
        self.point: str | None = None
        self.state: dict[str, Any] = {}
        #: The request's arguments, as ``start()`` recorded them.
        self.args: Any = None
        #: Holders so far, this one included.
        self.attempts = 0
        #: The last failure a holder recorded (a resumed request's).
        self.last_error: str | None = None
        #: True when this holder took the key over from an earlier one.
        self.resumed = False
        self.response: Response | None = None
        #: True once this holder stored the response.
        self.stored = False
        #: True once a write or a heartbeat of this holder was refused: the key was taken over,
        #: and every later write raises :class:`~pgonce.errors.LeaseLost` without being tried.
        self.lost = False
        #: True once this holder released the key (:meth:`release`): it holds nothing more.
        self.released = False
        self._busy = False
        #: The phases and calls this holder ran or read back: each once.
        self._visited: set[str] = set()
        #: True once this holder ran a call's work: the third party may have acted on it.
        self._called = False

    def _hold(
        self,
        claim: Won,
        token: int,
        point: str | None,
        state: dict[str, Any],
        args: Any,
        attempts: int,
        last_error: str | None = None,
    ) -> None:
        self.claim = claim
        self.token = token
        self.point = point
        self.state = state
        self.args = args
        self.attempts = attempts
        self.last_error = last_error

    @property
    def won(self) -> bool:
        return isinstance(self.claim, Won)

    @property
    def replayed(self) -> bool:
        return isinstance(self.claim, Replay)

    @property
    def in_flight(self) -> bool:
        return isinstance(self.claim, InFlight)

    def reached(self, phase: str) -> bool:
        """Whether ``phase`` was passed (by this holder or an earlier one)."""
        return check_phase(phase) in self.state

    def idempotency_key(self, phase: str) -> str:
        """The idempotency key ``phase`` hands to a third party: the same for every holder."""
        return provider_key(self.scope, self.key, check_phase(phase))

    async def phase(
        self,
        name: str,
        work: Callable[[AsyncConnection[Row]], Awaitable[Value]],
        *,
        now: datetime | None = None,
    ) -> Value:
        """Run ``work(conn)`` in a transaction of its own that records the phase; its value.

        The phase's writes (on ``conn``) and its recovery point commit together, fenced: a
        holder whose key was taken over commits nothing and gets
        :class:`~pgonce.errors.LeaseLost`. A phase already passed is skipped, and what it
        returned then is returned again (read back from JSON). The phase counts as passed only
        once its COMMIT succeeded: a phase whose commit failed runs again when retried.
        """
        self._check_holding(name, now, idle=True)
        _check_work(work, f"phase {name!r}'s work", "the connection")
        self._visit(name)
        if name in self.state:
            self._visited.add(name)
            return _as_read(self.state[name])  # type: ignore[no-any-return]
        conn = self._conn
        with self._exclusive():
            async with self._transaction("a phase"):
                value = await AsyncCallback.result(work(conn), f"phase {name!r}'s work")
                _check_not_ended(conn, f"phase {name!r}'s work", "the phase's transaction")
                state = await self._record(name, value, now)
        self._passed(name, state)
        return value

    async def call(
        self,
        name: str,
        work: Callable[[str], Awaitable[Value]],
        *,
        now: datetime | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> Value:
        """Call a third party outside any transaction with ``work(idempotency_key)``; its value.

        No transaction is open and no lock held while ``work`` runs. Its value is then recorded
        as the phase ``name`` in a short fenced transaction, so a retry skips the call and reads
        the value back; should the holder die before that, the retry calls again with the same
        idempotency key (:meth:`idempotency_key`), and the third party answers what it did.

        While ``work`` runs, a heartbeat renews the lease every ``heartbeat`` of the store on
        this connection (``work`` must not use it), so a call longer than the lease keeps the
        key. ``now`` is the time of the record; ``clock`` gives the time of each renewal
        (default: ``now``, or the database's clock when ``now`` is None); it is read once before
        the call, so that a clock that raises or gives no aware datetime fails here, not in the
        heartbeat, and the lease is renewed at that time before ``work`` runs: a holder whose key
        was taken over gets :class:`~pgonce.errors.LeaseLost` without calling the third party.
        A renewal that finds the key taken over means the call's value must not count: the
        heartbeat stops, and once ``work`` returns this raises
        :class:`~pgonce.errors.LeaseLost` without recording it.
        """
        self._check_holding(name, now, idle=True)
        _check_work(work, f"call {name!r}'s work", "the idempotency key")
        self._visit(name)
        started = now
        if clock is not None:
            if not callable(clock):
                raise UsageError("clock must be a function that returns a datetime, or None")
            started = _read(clock)
            check_optional_time(started, "the clock's time")
        if name in self.state:
            self._visited.add(name)
            return _as_read(self.state[name])  # type: ignore[no-any-return]

        async def beat() -> None:
            await self._renew(now if clock is None else _read(clock))

        with self._exclusive():
            # A whole lease from the start of the call: one begun late in its lease would be
            # up for the taking until the first beat, and a holder already taken over learns
            # it here, before it calls the third party.
            await self._renew(started)
            self._called = True
            conn = self._conn
            async with AsyncHeartbeat(
                beat, self._store.heartbeat, lambda: conn.closed
            ) as heartbeat:
                value = await AsyncCallback.result(
                    work(self.idempotency_key(name)), f"call {name!r}'s work"
                )
            if heartbeat.lost:
                raise self._lost()
            if heartbeat.error is not None:
                raise heartbeat.error
            if _in_transaction(self._conn):
                raise UsageError(_USED)
            async with self._transaction("recording a call"):
                state = await self._record(name, value, now)
        self._passed(name, state)
        return value

    async def _record(self, name: str, value: object, now: datetime | None) -> dict[str, Any]:
        """The phase's record, in the caller's transaction; the state it recorded, which
        counts only once that transaction committed."""
        check_state(value, name)
        # A copy, as a resume reads it: the caller keeps the value it got, and a change it makes
        # to it later must not be recorded with the next phase (nor fail that phase's record).
        state = {**self.state, name: _as_read(value)}
        with translate_errors("recording a phase"):
            cur = await cursor(self._conn).execute(
                self._store._sql.record,
                {**self._keyed(now), "point": name, "state": Jsonb(state)},
            )
        if cur.rowcount != 1:
            raise self._lost()
        return state

    def _visit(self, name: str) -> None:
        """Refuse a phase name this holder already ran or read back: the second would return
        the first one's value without running its work."""
        if name in self._visited:
            raise UsageError(
                f"phase {name!r} already ran for this holder: another phase or call of that name "
                "would return the first one's value without running; give each step a name of "
                "its own (f'charge-{i}'), and read a passed phase's value from op.state"
            )

    def _passed(self, name: str, state: dict[str, Any]) -> None:
        self.state = state
        self.point = name
        self._visited.add(name)

    async def renew(self, *, now: datetime | None = None) -> None:
        """The heartbeat: the lease runs for the store's ``lease`` from ``now`` on."""
        self._check_holding(None, now, idle=True)
        with self._exclusive():
            await self._renew(now)

    async def _renew(self, now: datetime | None) -> None:
        self._check_holding(None, now)
        if _in_transaction(self._conn):
            # Only a call's work can have opened it (renew() checks first): the renewal would
            # be a savepoint of that transaction, gone with its rollback.
            raise UsageError(_USED)
        with translate_errors("renewing a lease"):
            async with self._conn.transaction():
                cur = await cursor(self._conn).execute(self._store._sql.renew, self._keyed(now))
        if cur.rowcount != 1:
            raise self._lost()

    async def finish(
        self,
        response: Response,
        *,
        writes: Callable[[AsyncConnection[Row]], Awaitable[None]] | None = None,
        now: datetime | None = None,
        force: bool = False,
    ) -> bool:
        """Store ``response`` as the key's answer with ``writes(conn)``, in one fenced
        transaction; True when stored.

        A 5xx that is not stored (see :class:`AsyncPhaseStore`) ends the lease instead (as
        :meth:`fail`): the key stays claimed, and the next retry resumes from the recovery point.
        ``force`` stores it whatever its status (the completer's retired answer).
        """
        self._check_holding(None, now, idle=True)
        validate_response(response)
        if writes is not None:
            _check_work(writes, "the answer's writes", "the connection")
        conn = self._conn
        with self._exclusive():
            if not force and not self._store.stores(response):
                await self._fail(f"answered {response.status}", now)
                return False
            async with self._transaction("storing a two-phase answer"):
                if writes is not None:
                    await AsyncCallback.result(writes(conn), "the answer's writes")
                    _check_not_ended(conn, "the answer's writes", "the answer's transaction")
                await self._store_answer(self._store._sql.finish, response, now)
        self._answered(response)
        return True

    async def retire(self, *, now: datetime | None = None) -> Response:
        """Give the request up: store the retired problem answer (500) in one fenced
        transaction; the answer.

        The completer's end of a request whose holders kept failing. Every retry replays the
        answer, and nothing runs again. Unlike :meth:`finish`, the lease row is kept (with
        ``locked_until`` infinity) as the record of the retirement, with the recovery point, the
        attempts and the last error: the health check counts it (``retired requests``) until
        the sweeper deletes the key. No write of this holder is accepted after it.
        """
        self._check_holding(None, now, idle=True)
        response = retired_response(self.scope, self.key, self.attempts - 1, self.last_error)
        with self._exclusive():
            async with self._transaction("retiring a two-phase request"):
                await self._store_answer(self._store._sql.retire, response, now)
        self._answered(response)
        return response

    async def _store_answer(
        self, statement: bytes, response: Response, now: datetime | None
    ) -> None:
        status, headers, body = response.status, [list(h) for h in response.headers], response.body
        params = {**self._keyed(now), "status": status, "headers": Jsonb(headers), "body": body}
        with translate_errors("storing a two-phase answer"):
            cur = await cursor(self._conn).execute(statement, params)
        if cur.rowcount != 1:
            raise self._lost()

    def _answered(self, response: Response) -> None:
        """The answer is stored (its transaction committed): this holder's work is over."""
        self.response = response
        self.stored = True

    async def fail(self, error: str, *, now: datetime | None = None) -> None:
        """End the lease now and note ``error``: the next retry, or the completer, takes over at
        once and resumes from the recovery point. Refused (:class:`LeaseLost`) when already
        taken over."""
        self._check_holding(None, now, idle=True)
        check_str(error, "the error")
        with self._exclusive():
            await self._fail(error, now)

    async def _fail(self, error: str, now: datetime | None) -> None:
        with translate_errors("ending a lease"):
            async with self._conn.transaction():
                cur = await cursor(self._conn).execute(
                    self._store._sql.fail, {**self._keyed(now), "error": error[:1000]}
                )
        if cur.rowcount != 1:
            raise self._lost()

    async def release(self, *, now: datetime | None = None) -> None:
        """Free the key of a request that never began: its claim and its lease are deleted, in
        one fenced transaction, as a one-transaction route's rollback frees its key.

        For a request refused before its endpoint ran (authentication, validation): the next
        request with the key is a new claim. Refused (:class:`~pgonce.errors.UsageError`) once
        a phase was recorded, by this holder or an earlier one, once this holder called a third
        party, and for a holder that took the key over (:attr:`resumed`): an earlier holder may
        have called the third party and died before recording it. That request resumes instead.
        """
        self._check_holding(None, now, idle=True)
        if self.state:
            raise UsageError(
                "a request that recorded a phase is resumed, not released: end its lease "
                "with fail()"
            )
        if self._called or self.resumed:
            # Its value may not have been recorded, but the third party may have acted (this
            # holder's call, or an earlier holder's that died before its record): the next
            # request with the key would hand it the same idempotency key.
            raise UsageError(
                "a request that called a third party, or that took its key over from an earlier "
                "holder, is resumed, not released, even when no call's value was recorded: end "
                "its lease with fail()"
            )
        with self._exclusive():
            async with self._transaction("releasing a two-phase key"):
                cur = await cursor(self._conn).execute(self._store._sql.release, self._keyed(now))
                if cur.rowcount != 1:
                    raise self._lost()
        # Nothing of this holder remains: no later write of it is tried.
        self.released = True

    async def run(self, work: Work, *, now: datetime | None = None) -> Response:
        """Run ``work(self)`` and store the answer it returns; the answer.

        For a claim that did not win, nothing runs: the answer is the stored one (a replay) or
        None (in flight). An exception in the work ends the lease (:meth:`fail`) and
        propagates: the next retry resumes from the recovery point. A :class:`LeaseLost`
        propagates as it is: the key is the new holder's.
        """
        if not self.won:
            return self.response  # type: ignore[return-value]
        _check_work(work, "the request's work", "the operation")
        try:
            response = await AsyncCallback.result(work(self), "the request's work")
            await self.finish(response, now=now)
        except LeaseLost:
            raise
        except Exception as error:
            if self.released or self.stored:
                # The work freed its key or stored its answer itself: no lease is left to end,
                # and its error is the one to see.
                raise
            if _in_transaction(self._conn):
                # The work used the connection outside its phases and left a transaction of
                # its own open: an end of lease there would commit with it or not at all.
                error.add_note(
                    "pgonce did not end the lease: the work left the connection inside a "
                    "transaction; the lease runs out by itself"
                )
                raise
            # After a failed phase or call: the connection is idle again (the phase's
            # transaction was rolled back), and this short transaction records the failure.
            await self.fail(failure_note(error), now=now)
            raise
        return response

    def _check_holding(
        self, phase: str | None, now: datetime | None, *, idle: bool = False
    ) -> None:
        if not self.won:
            raise UsageError("only the holder of a two-phase claim (op.won) runs its phases")
        if phase is not None:
            check_phase(phase)
        check_optional_time(now)
        if self.stored:
            raise UsageError(
                "this two-phase request is already finished (its answer is stored): no write "
                "of its holder is accepted after it"
            )
        if self.released:
            raise UsageError(
                "this two-phase key was released (release()): its holder holds nothing more, "
                "and the next request with the key is a new claim"
            )
        if self.lost:
            raise LeaseLost(self.scope, self.key, self.token)
        if idle and self._busy:
            raise UsageError(_BUSY)
        # A connection lost meanwhile is not in a transaction: the write itself then raises
        # DatabaseUnavailable, as the first write after the loss did.
        if idle and _in_transaction(self._conn):
            raise UsageError(
                "each phase of a two-phase key commits in a transaction of its own: the "
                "connection must be idle, outside a transaction"
            )

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One write of this holder at a time: its phases commit in turn on one connection,
        each recording the state the one before left."""
        if self._busy:
            raise UsageError(_BUSY)
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    @asynccontextmanager
    async def _transaction(self, what: str) -> AsyncIterator[None]:
        """A transaction of pgonce's own on the holder's connection: its BEGIN and COMMIT fail
        as pgonce's errors (a lost connection is DatabaseUnavailable); what the block raises,
        the caller's work included, propagates as it is after the rollback."""
        transaction = self._conn.transaction()
        with translate_errors(f"starting {what}"):
            await transaction.__aenter__()
        try:
            yield
        except BaseException as error:
            # psycopg logs and ignores a failed ROLLBACK: the block's error is the one to see.
            await transaction.__aexit__(type(error), error, error.__traceback__)
            raise
        with translate_errors(f"committing {what}"):
            await transaction.__aexit__(None, None, None)

    def _lost(self) -> LeaseLost:
        """The key was taken over: no later write of this holder is tried."""
        self.lost = True
        return LeaseLost(self.scope, self.key, self.token)

    def _keyed(self, now: datetime | None) -> dict[str, Any]:
        store = self._store
        return {
            "scope": self.scope,
            "key": self.key,
            "token": self.token,
            "now": now,
            "lease": store.lease,
        }


def _check_max_age(max_age: object) -> None:
    """Refuse a ``max_age`` that is not a positive timedelta PostgreSQL can subtract from now:
    zero or less leaves every request alone, in silence; a huge one failed every pass as
    "timestamp out of range". None (not checked here) is any age."""
    value = check_duration(max_age, "max_age")
    if not timedelta(0) < value <= _MAX_AGE_LIMIT:
        raise UsageError(
            f"max_age must be positive and at most {_MAX_AGE_LIMIT.days} days (None: any "
            f"age), not {value}: the completer would take no request, or fail every pass"
        )


def _read(clock: Callable[[], datetime]) -> datetime:
    """The time a call's ``clock`` gives. One that raises is a broken contract, as one that gives
    a naive datetime (a UsageError that ends the heartbeat), not a renewal that failed: the
    heartbeat would log it as the database away and retry it while the lease ran out."""
    try:
        return clock()
    except Exception as error:
        raise UsageError(
            f"the clock raised {type(error).__name__} ({error}): it must give the time of "
            "each renewal, an aware datetime, or None for the database's clock"
        ) from error


def _check_operations(operations: object) -> None:
    """Refuse a completer's registry that is not a mapping of names to functions: before any
    takeover, as a registered work that cannot run would fail every request of its operation
    until the completer retired them all."""
    if not isinstance(operations, Mapping):
        raise UsageError(
            "operations maps each operation's name to its registered work, not "
            f"{type(operations).__name__}"
        )
    for name, registered in operations.items():
        _check_work(registered, f"the registered work of {name!r}", "the operation")


def _check_work(work: object, what: str, argument: str) -> None:
    """Refuse work that cannot be called, before anything is written or renewed: a call's
    would otherwise count as called (its key then never released) and fail as a TypeError."""
    if not callable(work):
        raise UsageError(f"{what} must be a function that takes {argument}, not {describe(work)}")
    AsyncCallback.check(work, what)


def _check_not_ended(conn: AsyncConnection[Any], work: str, transaction: str) -> None:
    """Refuse to record anything in a transaction that the caller's work ended itself (a COMMIT
    or ROLLBACK sent as SQL): the record would commit on its own, after writes that were undone
    (a retry would skip them) or that committed unfenced (a holder taken over wrote anyway); or
    in one that a statement of the work aborted."""
    status = conn.info.transaction_status
    if status == TransactionStatus.IDLE:
        raise UsageError(
            f"{work} ended {transaction} (a COMMIT or ROLLBACK sent as SQL): its writes were "
            "committed or undone apart from its record, and nothing was recorded; pgonce "
            "commits each phase with its writes: let the work return, or raise to undo them"
        )
    if status == TransactionStatus.INERROR:
        # A statement of the work failed and the work went on: the record cannot run in an
        # aborted transaction, and what failed is the work's, not pgonce's.
        raise UsageError(
            f"{work} returned in {transaction} aborted by one of its statements (an error it "
            "caught): nothing was recorded and its writes are undone; let the error propagate, "
            "or wrap the statement that may fail in conn.transaction() (a savepoint)"
        )


def _as_read(value: object) -> Any:
    """A recorded value (checked by ``check_state``) as a resume reads it back: a copy of its own,
    so that what the caller does with the one it holds changes nothing recorded."""
    return json.loads(json.dumps(value))


def _in_transaction(conn: AsyncConnection[Any]) -> bool:
    """Whether ``conn`` is inside a transaction that pgonce did not open (or in a statement)."""
    return conn.info.transaction_status in (
        TransactionStatus.INTRANS,
        TransactionStatus.INERROR,
        TransactionStatus.ACTIVE,
    )


def _taken(
    row: tuple[Any, ...],
) -> tuple[int, str | None, dict[str, Any], Any, int, str | None]:
    """token, point, state, args, attempts, last_error of a take_over row that took over."""
    return row[6], row[7], dict(row[8]), row[9], row[10], row[11]
