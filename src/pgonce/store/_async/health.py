"""Health: the stuck-claims query and the retention horizon from both ends, as a typed report.

The store reads the facts (``queries/health.sql``) in one read-only transaction with a statement
timeout; :func:`pgonce.core.retention.assess` judges them. The report is what ``pgonce doctor``
prints and what the service exposes as metrics. This file is the source of ``_sync/health.py``
(``tools/gen_sync.py``); edit this one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from psycopg import AsyncConnection, AsyncCursor

from pgonce.config import DEFAULT_SCHEMA
from pgonce.core.checks import check_connection, check_duration, check_optional_time
from pgonce.core.durability import Durability, judge_durability
from pgonce.core.mvcc import (
    DEFAULT_HORIZON_WARN,
    DEFAULT_XMIN_AGE_WARN,
    MvccHorizon,
    judge_mvcc_horizon,
)
from pgonce.core.retention import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_RETIRED_WINDOW,
    DEFAULT_SLACK,
    DEFAULT_STUCK_AFTER,
    TARGETS,
    GroupFacts,
    HealthReport,
    RetentionPolicy,
    ServerTimeout,
    StuckFacts,
    SweepLimits,
    assess,
    judge_schema,
    judge_server_timeouts,
    policies_for,
)
from pgonce.errors import DatabaseUnavailable, UsageError
from pgonce.sql import Queries, migrations
from pgonce.store.common import check_schema
from pgonce.store.cursors import cursor
from pgonce.store.errors import translate_errors

Row = TypeVar("Row")


class AsyncHealthCheck:
    """Reads the health figures of every sweep target under the same policies the sweeper uses.

    ``stuck_after``: a claim in flight older than this is stuck. ``slack``: how far the oldest row
    may outlive its retention before the sweeper counts as stalled. ``horizon_warn``: an open
    transaction older than this pins the MVCC horizon long enough to warn about. ``xmin_warn``:
    an xmin older than this many transaction ids is warned about even with no old transaction
    open (a replication slot holds it, with no session to show).
    ``retired_window``: a two-phase request the completer retired within this window is a
    warning (older ones are still counted).
    """

    def __init__(
        self,
        policies: Iterable[RetentionPolicy] = (),
        *,
        schema: str = DEFAULT_SCHEMA,
        targets: Iterable[str] | None = None,
        stuck_after: timedelta = DEFAULT_STUCK_AFTER,
        slack: timedelta = DEFAULT_SLACK,
        timeout: timedelta = DEFAULT_HEALTH_TIMEOUT,
        horizon_warn: timedelta = DEFAULT_HORIZON_WARN,
        retired_window: timedelta = DEFAULT_RETIRED_WINDOW,
        xmin_warn: int = DEFAULT_XMIN_AGE_WARN,
    ) -> None:
        check_schema(schema)
        # Checked here, not at the first check: a number or a negative span reached the server
        # as a bad cast there, or the judgement as a bare TypeError.
        for name, span in (
            ("stuck_after", stuck_after),
            ("slack", slack),
            ("horizon_warn", horizon_warn),
            ("retired_window", retired_window),
        ):
            if check_duration(span, name) < timedelta(0):
                raise UsageError(f"{name} must not be negative, not {span}")
        if isinstance(xmin_warn, bool) or not isinstance(xmin_warn, int) or xmin_warn < 0:
            raise UsageError(
                f"xmin_warn must be a count of transaction ids >= 0, not {xmin_warn!r}"
            )
        self.horizon_warn = horizon_warn
        self.xmin_warn = xmin_warn
        self.retired_window = retired_window
        self.policies = policies_for(policies, targets)
        self.stuck_after = stuck_after
        self.slack = slack
        # SweepLimits validates and renders the timeout the way set_config wants it.
        self._timeout_ms = SweepLimits(statement_timeout=timeout).timeout_ms
        #: The whole check's bound: the statement timeout is the server's, and a stalled network
        #: (requests arrive, answers do not) never brings its error back. Twice the statement
        #: timeout leaves a slow table its due, and ends a check that would otherwise wait forever
        #: (a metrics scrape holding a pooled connection for good, every scrape one more).
        self.deadline = 2 * timeout
        self._sql = Queries("health", schema)
        self._sweep_sql = Queries("sweep", schema)

    async def check(
        self, conn: AsyncConnection[Row], *, now: datetime | None = None
    ) -> HealthReport:
        """Read the figures and judge them; ``now`` replaces the server's clock (tests).

        A naive ``now`` is refused, as the sweeper refuses it: read in the session's time zone, it
        would shift every age the report judges.
        """
        check_connection(conn, AsyncConnection, self)
        check_optional_time(now)
        watchdog = _Watchdog(conn, self.deadline.total_seconds())
        try:
            with translate_errors("checking health"), watchdog:
                return await self._read(conn, now)
        except DatabaseUnavailable as error:
            if not watchdog.fired:
                raise
            raise _stalled(
                DatabaseUnavailable(
                    f"checking health failed: no answer within {self.deadline} (twice the "
                    "statement timeout), so the connection was closed: the server or the network "
                    "is stalled"
                )
            ) from error

    async def _read(self, conn: AsyncConnection[Row], now: datetime | None) -> HealthReport:
        groups: list[GroupFacts] = []
        stuck: list[StuckFacts] = []
        # One transaction: every figure is read at the same `now()`, under one statement timeout.
        # Rolled back, as nothing here writes: inside the caller's transaction this is a
        # savepoint, and only rolling it back ends the SET LOCAL with it (released, the timeout
        # would bound the rest of the caller's transaction).
        async with conn.transaction(force_rollback=True):
            cur = cursor(conn)
            await cur.execute(self._sweep_sql.statement_timeout, {"timeout_ms": self._timeout_ms})
            await cur.execute(self._sql.clock, {"now": now})
            clock_row = await cur.fetchone()
            assert clock_row is not None
            checked_at: datetime = clock_row[0]
            for policy in self.policies:
                horizon = getattr(self._sql, f"horizon_{policy.target}")
                await cur.execute(horizon, policy.params(now))
                groups.extend(_group_facts(policy, await cur.fetchall()))
                if TARGETS[policy.target].has_stuck:
                    params = {"now": now, "stuck_after": self.stuck_after}
                    await cur.execute(getattr(self._sql, f"stuck_{policy.target}"), params)
                    count, oldest = await cur.fetchone() or (0, None)
                    facts = StuckFacts(policy.target, self.stuck_after, count, oldest)
                    if policy.target == "keys":
                        facts = await self._two_phase(cur, facts, params)
                    stuck.append(facts)
            durability = await self._durability(cur)
            mvcc = await self._mvcc_horizon(cur)
            # reset_val: what the session started with, before this check's SET LOCAL.
            await cur.execute(self._sql.server_timeouts)
            timeouts = [ServerTimeout(*row) for row in await cur.fetchall()]
            await cur.execute(self._sql.schema_version)
            version_row = await cur.fetchone()
            schema_version = int(version_row[0]) if version_row else 0
        report = assess(
            checked_at, groups, stuck, slack=self.slack, retired_window=self.retired_window
        )
        return replace(
            report,
            durability=durability,
            mvcc=mvcc,
            findings=(
                # First: a pending migration explains whatever else fails.
                judge_schema(schema_version, migrations()[-1].version),
                *report.findings,
                judge_durability(durability),
                judge_mvcc_horizon(mvcc, self.horizon_warn, self.xmin_warn),
                judge_server_timeouts(timeouts),
            ),
        )

    async def _two_phase(
        self, cur: AsyncCursor[tuple[Any, ...]], facts: StuckFacts, params: dict[str, Any]
    ) -> StuckFacts:
        """Two-phase requests: stuck (by recovery point) and retired by the completer."""
        await cur.execute(self._sql.stuck_phases, params)
        phases = tuple((point, n) for point, n in await cur.fetchall())
        await cur.execute(self._sql.retired_phases, params)
        rows = await cur.fetchall()
        retired = tuple((point, n) for point, n, _ in rows)
        newest = min((age for _, _, age in rows), default=None)
        return replace(facts, phases=phases, retired=retired, retired_age=newest)

    async def durability(self, conn: AsyncConnection[Row]) -> Durability:
        """Whether the server has the synchronous standby it is configured for (one query).

        Bounded like :meth:`check`: a readiness probe on a stalled network must end, not hold
        its pooled connection for good.
        """
        check_connection(conn, AsyncConnection, self)
        watchdog = _Watchdog(conn, self.deadline.total_seconds())
        with translate_errors("reading the synchronous standbys"), watchdog:
            return await self._durability(cursor(conn))

    async def _durability(self, cur: AsyncCursor[tuple[Any, ...]]) -> Durability:
        await cur.execute(self._sql.sync_standby)
        configured, synchronous, unknown, read_only = await cur.fetchone() or (False, 0, 0, False)
        return Durability(bool(configured), synchronous, unknown, bool(read_only))

    async def _mvcc_horizon(self, cur: AsyncCursor[tuple[Any, ...]]) -> MvccHorizon:
        await cur.execute(self._sql.mvcc_horizon)
        row = await cur.fetchone()
        if row is None:
            return MvccHorizon(None, None, 0, False)
        oldest, state, xmin_age, sees_all, pid, application_name, what, slot, slot_age = row
        return MvccHorizon(
            oldest,
            state,
            int(xmin_age),
            bool(sees_all),
            pid=pid,
            application_name=application_name,
            what=what,
            slot=slot,
            slot_xmin_age=int(slot_age),
        )


def _group_facts(
    policy: RetentionPolicy,
    rows: list[tuple[str | None, timedelta | None, int, timedelta | None]],
) -> list[GroupFacts]:
    """One entry per scope group of the policy, in the policy's order."""
    found = {scope: (oldest, overdue, deleted) for scope, oldest, overdue, deleted in rows}
    return [
        GroupFacts(
            policy.target, scope, policy.for_scope(scope), *found.get(scope, (None, 0, None))
        )
        for scope in policy.groups()
    ]


#: The attribute that marks a failure as a stall (see stalled()).
_STALLED = "pgonce_stalled"


def _stalled(error: DatabaseUnavailable) -> DatabaseUnavailable:
    setattr(error, _STALLED, True)
    return error


def stalled(error: BaseException) -> bool:
    """Whether ``error`` is a bound running out: no answer came in time, and the connection was
    closed. Asking again on another connection through the same network would wait as long."""
    return getattr(error, _STALLED, False) is True


@contextlib.contextmanager
def answered_within(conn: AsyncConnection[Any], seconds: float, what: str) -> Iterator[None]:
    """Bound the block's statements on ``conn`` by ``seconds`` of wall time, whatever the network.

    A server's statement timeout never comes back over a stalled network (requests arrive,
    answers do not); past ``seconds`` the connection's socket is shut down and the block fails
    with :class:`~pgonce.errors.DatabaseUnavailable` naming ``what`` and the bound (and
    :func:`stalled` says so). psycopg's errors inside are translated as ``translate_errors(what)``
    does.
    """
    watchdog = _Watchdog(conn, seconds)
    try:
        with translate_errors(what), watchdog:
            yield
    except DatabaseUnavailable as error:
        if not watchdog.fired:
            raise
        raise _stalled(
            DatabaseUnavailable(
                f"{what} failed: no answer within {seconds:g}s, so the connection was closed: "
                "the server or the network is stalled"
            )
        ) from error


class _Watchdog:
    """Shuts the connection's socket down if the block it guards outlives ``seconds``.

    A thread, in both twins: cancelling the coroutine would not do, since psycopg answers a
    cancellation by asking the server to cancel and waiting for the answer that the stalled
    network holds back. Shutting the socket down wakes whatever waits on it with end-of-file, so
    the statement fails at once as a lost connection, which the pool then discards. The lock keeps
    the shutdown from landing after the block has left (the connection is the caller's again).
    """

    __slots__ = ("_conn", "_done", "_fd", "_lock", "_timer", "fired")

    def __init__(self, conn: AsyncConnection[Any], seconds: float) -> None:
        self._conn = conn
        self._fd = -1
        self._lock = threading.Lock()
        self._done = False
        self.fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.name = "pgonce-health-watchdog"
        self._timer.daemon = True

    def __enter__(self) -> None:
        self._fd = self._conn.fileno()  # a closed connection fails here, inside translate_errors
        self._timer.start()

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()

    def _fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.fired = True
            # A duplicate of the descriptor: shutdown() acts on the socket itself, and closing the
            # duplicate leaves the connection's own descriptor to psycopg.
            with socket.socket(fileno=os.dup(self._fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
