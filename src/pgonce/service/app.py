"""The service's ASGI app: webhook endpoints, health, readiness, metrics and the admin page.

``POST /webhooks/{source}`` goes straight to the inbox receiver (a plain ASGI app) through a thin
wrapper that counts outcomes; everything else is a small Starlette app. Neither keeps per-request
state on an instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection

from pgonce import sql as pgsql
from pgonce.core.durability import READ_ONLY_DETAIL, Durability
from pgonce.errors import DatabaseUnavailable
from pgonce.extras import needs
from pgonce.http.problem import send_problem
from pgonce.service.admin import Admin
from pgonce.service.metrics import CONTENT_TYPE, ServiceMetrics
from pgonce.store._async.health import AsyncHealthCheck, answered_within, stalled
from pgonce.store._async.inspect import AsyncInspector
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store.cursors import cursor
from pgonce.webhooks.receiver import RETRY_AFTER_SECONDS, InboxReceiver

with needs("server", "the pgonce service"):
    from psycopg_pool import AsyncConnectionPool
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

WEBHOOK_PREFIX = "/webhooks/"
log = logging.getLogger("pgonce.service")
T = TypeVar("T")

#: The server's bound on each of /readyz's and /metrics' own statements (SET LOCAL
#: statement_timeout, which counts lock waits too): a table locked by a migration or a slow
#: server answers 503 (or ``pgonce_up 0``) within it instead of holding the probe, and its pooled
#: connection, for as long as the lock lasts. The health figures of /metrics keep their own,
#: longer bound (:class:`~pgonce.store._async.health.AsyncHealthCheck`'s timeout).
PROBE_STATEMENT_MS = 5000
_PROBE_TIMEOUT = {"timeout_ms": str(PROBE_STATEMENT_MS)}

#: The bound of a whole /readyz answer, the pool's wait included. A stalled network (requests
#: go out, answers never come back) is not ended by the server's statement timeout: past this,
#: the probe answers 503 and the database work is cancelled behind it.
READY_DEADLINE = 10.0

#: The wall-time bound of /metrics' backlog reads (queue depths, outbox lag, table sizes) on
#: their connection: twice their statement timeout. Past it the connection's socket is shut, the
#: connection discarded, and the scrape answers at once with the last figures it read, with
#: ``pgonce_database_up 0`` and ``pgonce_metrics_read_failures{reason="no_answer"}`` counted.
SCRAPE_READ_DEADLINE = 2 * PROBE_STATEMENT_MS / 1000


async def _within(work: Awaitable[Any], seconds: float) -> Any:
    """``work``'s result, or :class:`TimeoutError` after ``seconds``, whatever ``work`` does.

    ``asyncio.timeout`` would not do: psycopg answers a cancellation by asking the server to
    cancel the query and waiting for that (up to ten seconds on a stalled network) before the
    cancellation comes through. Here the answer goes at the deadline; the cancelled work ends
    behind it and its connection goes back to the pool, which discards a broken one.
    """
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        _abandon(task)
        raise
    if not done:
        _abandon(task)
        raise TimeoutError(f"no answer within {seconds}s")
    return task.result()


#: Cancelled probes still ending: the event loop keeps only weak references to tasks.
_ABANDONED: set[asyncio.Future[Any]] = set()


def _abandon(task: asyncio.Future[Any]) -> None:
    task.cancel()
    _ABANDONED.add(task)

    def ended(done: asyncio.Future[Any]) -> None:
        _ABANDONED.discard(done)
        # Its end (a cancellation, or the error of a closed connection) is nobody's to report.
        if not done.cancelled():
            done.exception()

    task.add_done_callback(ended)


class ServiceApp:
    """The whole HTTP surface of ``pgonce serve``."""

    def __init__(
        self,
        *,
        pool: AsyncConnectionPool[Any],
        schema: str,
        receiver: InboxReceiver | None,
        metrics: ServiceMetrics,
        health: AsyncHealthCheck,
        admin: Admin,
    ) -> None:
        self.pool = pool
        self.receiver = receiver
        self.metrics = metrics
        self.health = health
        self.inspector = AsyncInspector(schema=schema)
        self.outbox = AsyncOutboxStore(schema=schema)
        self.latest_migration = pgsql.migrations()[-1].version
        self._statement_timeout = pgsql.Queries("sweep", schema).statement_timeout
        #: The scrape reading the database now, if any: one at a time (see metrics_page).
        self._scraping: asyncio.Future[None] | None = None
        self.http = Starlette(
            routes=[
                Route("/healthz", self.healthz),
                Route("/readyz", self.readyz),
                Route("/metrics", self.metrics_page),
                *admin.routes(),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and self.receiver is not None
            and scope["path"].startswith(WEBHOOK_PREFIX)
        ):
            await self._webhook(scope, receive, send)
        else:
            await self.http(scope, receive, send)

    async def _webhook(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.receiver is not None
        started = time.perf_counter()
        name = scope["path"][len(WEBHOOK_PREFIX) :]
        # Only configured names become labels: a scan of random paths must not grow the metrics.
        source = name if name in self.receiver.sources else "unknown"
        # As the receiver names it; "error" when it raised instead (the server answers 500).
        outcome = "error"
        answered = False

        async def watch(message: Message) -> None:
            nonlocal answered
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            try:
                outcome = await self.receiver.respond(scope, receive, watch)
            except asyncio.CancelledError:
                if answered:
                    raise
                # The stop's bound ran out while this delivery waited (SIGTERM), or a second
                # signal cut the wait. Whether or not its row commits behind the cut, a retry is
                # safe (a stored one is answered as a duplicate): the sender is told to retry, not
                # handed uvicorn's bare 500. Named "stopping", not "unavailable": the database
                # may be fine, and an alert on unreachable storage must not fire for a deploy.
                outcome = "stopping"
                log.warning(
                    "a delivery to %s was cut by the stop before it was answered; answered 503",
                    source,
                    extra={"source": source, "outcome": outcome},
                )
                await send_problem(
                    watch,
                    503,
                    detail="the service stopped before the delivery was answered; retry later",
                    headers=[("retry-after", str(RETRY_AFTER_SECONDS))],
                )
        finally:
            self.metrics.deliveries.labels(source, outcome).inc()
            self.metrics.delivery_seconds.labels(source).observe(time.perf_counter() - started)

    async def healthz(self, request: Request) -> Response:
        """Alive: the process answers. Says nothing about the database (that is /readyz)."""
        return JSONResponse({"status": "alive"})

    async def readyz(self, request: Request) -> Response:
        """Ready: the database answers and is migrated to the version this code needs.

        The answer also says whether the server has the synchronous standby it is configured
        for (``synchronous_standby``: see :mod:`pgonce.core.durability`). A missing one does not
        make the service unready (it can still answer), but ``durability`` says "reduced".
        """
        try:
            version, durability = await _within(self._readiness(), READY_DEADLINE)
        except Exception as error:
            # pgonce's errors, the pool's timeout, a refused connection, no answer: all mean
            # "not ready".
            return JSONResponse(
                {"status": "unavailable", "detail": type(error).__name__}, status_code=503
            )
        if version < self.latest_migration:
            return JSONResponse(
                {"status": "not migrated", "schema": version, "needs": self.latest_migration},
                status_code=503,
            )
        if durability.read_only:
            return JSONResponse(
                {"status": "read-only", "schema": version, "detail": READ_ONLY_DETAIL},
                status_code=503,
            )
        state = durability.state
        return JSONResponse(
            {
                "status": "ready",
                "schema": version,
                "synchronous_standby": state,
                "durability": "reduced" if state == "none" else "as configured",
            }
        )

    async def _readiness(self) -> tuple[int, Durability]:
        # The pool's own wait bound (pool_wait): a probe must not wait longer than requests.
        return await self._on_live_connection(self._read_readiness, None)

    async def _read_readiness(self, conn: AsyncConnection[Any]) -> tuple[int, Durability]:
        await cursor(conn).execute(self._statement_timeout, _PROBE_TIMEOUT)
        version = await self.inspector.schema_version(conn)
        await conn.rollback()
        durability = await self.health.durability(conn)
        await conn.rollback()
        return version, durability

    async def _on_live_connection(
        self, work: Callable[[AsyncConnection[Any]], Awaitable[T]], wait: float | None
    ) -> T:
        """``work`` on a pooled connection, again on another when the first one was dead.

        After a restart or a failover every idle pooled connection is dead, and the pool finds
        out only by using one: a probe said "unavailable" (a scrape ``pgonce_database_up 0``)
        once per idle connection while the database answered. A connection found closed is
        discarded; the pool opens a fresh one when none is left.
        """
        for attempt in range(1, self.pool.max_size + 2):
            async with self.pool.connection(timeout=wait) as conn:
                try:
                    return await work(conn)
                except (psycopg.OperationalError, DatabaseUnavailable) as error:
                    # A connection closed because no answer came in time is no dead pooled
                    # connection: another one through the same stalled network waits as long.
                    if not conn.closed or stalled(error) or attempt > self.pool.max_size:
                        raise
        raise AssertionError("unreachable")

    async def metrics_page(self, request: Request) -> Response:
        """The metrics, with the database's figures read now, or the last ones read.

        One scrape reads the database at a time: a scrape that arrives while another still
        reads (a slow server, a stalled network) waits for that one's figures instead of taking
        one more pooled connection, so that scrapes never pile up on the pool. A read that fails
        or gets no answer in time leaves the database's gauges at their last figures, sets
        ``pgonce_database_up`` to 0 and counts ``pgonce_metrics_read_failures`` by reason.
        """
        # The pool's wait and the backlog's statements, then the health check within its own
        # deadline: each is bounded on its own, this is the backstop of the whole answer. The
        # read itself is never cancelled (psycopg's cancellation waits for the server too): it
        # ends at its own bounds, and the next scrape reads again.
        deadline = 5 + SCRAPE_READ_DEADLINE + self.health.deadline.total_seconds()
        scraping = self._scraping
        if scraping is None or scraping.done():
            scraping = self._scraping = asyncio.ensure_future(self._scrape(datetime.now(UTC)))
        try:
            await _within(asyncio.shield(scraping), deadline)
            self.metrics.up.set(1)
        except Exception as error:
            # Metrics must answer even when the database does not: that is what they report.
            self.metrics.up.set(0)
            self.metrics.record_read_failure(_read_failure(error))
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def _scrape(self, now: datetime) -> None:
        async def read(conn: AsyncConnection[Any]) -> None:
            with answered_within(conn, SCRAPE_READ_DEADLINE, "reading the backlogs"):
                await cursor(conn).execute(self._statement_timeout, _PROBE_TIMEOUT)
                inbox = await self.inspector.inbox_backlog(conn)
                outbox = await self.outbox.backlog(conn)
                tables = await self.inspector.table_estimates(conn)
                await conn.rollback()
            self.metrics.set_inbox(inbox, now)
            self.metrics.set_outbox(outbox, now)
            self.metrics.set_tables(tables)
            self.metrics.set_health(await self.health.check(conn))

        await self._on_live_connection(read, 5)


def _read_failure(error: BaseException) -> str:
    """The reason label of a failed scrape read: ``no_answer`` for a bound that ran out."""
    if isinstance(error, TimeoutError) or stalled(error):
        return "no_answer"
    return type(error).__name__
