"""The service's ASGI app: webhook endpoints, health, readiness, metrics and the admin page.

``POST /webhooks/{source}`` goes straight to the inbox receiver (a plain ASGI app) through a thin
wrapper that counts outcomes; everything else is a small Starlette app. Neither keeps per-request
state on an instance.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from datetime import UTC, datetime
from typing import Any

from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pgonce import sql as pgsql
from pgonce.service.admin import Admin
from pgonce.service.metrics import CONTENT_TYPE, ServiceMetrics
from pgonce.store._async.health import AsyncHealthCheck
from pgonce.store._async.inspect import AsyncInspector
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.webhooks.receiver import InboxReceiver

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: The outcome label of a receiver's answer, by status, when the body does not name one.
_OUTCOME_BY_STATUS = {
    400: "bad_payload",
    401: "rejected_signature",
    404: "unknown_source",
    405: "bad_method",
    409: "conflict",
    413: "too_large",
    503: "unavailable",
}
WEBHOOK_PREFIX = "/webhooks/"


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
        answer: dict[str, Any] = {}

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body" and answer.get("status") == 200:
                body = bytes(message.get("body", b""))
                answer["outcome"] = "duplicate" if b'"duplicate"' in body else "stored"
            await send(message)

        try:
            await self.receiver(scope, receive, watch)
        finally:
            status = answer.get("status", 500)
            outcome = answer.get("outcome") or _OUTCOME_BY_STATUS.get(status, f"http_{status}")
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
            # The pool's own wait bound (pool_wait): a probe must not wait longer than requests.
            async with self.pool.connection() as conn:
                version = await self.inspector.schema_version(conn)
                durability = await self.health.durability(conn)
                await conn.rollback()
        except Exception as error:
            # pgonce's errors, the pool's timeout, a refused connection: all mean "not ready".
            return JSONResponse(
                {"status": "unavailable", "detail": type(error).__name__}, status_code=503
            )
        if version < self.latest_migration:
            return JSONResponse(
                {"status": "not migrated", "schema": version, "needs": self.latest_migration},
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

    async def metrics_page(self, request: Request) -> Response:
        now = datetime.now(UTC)
        try:
            async with self.pool.connection(timeout=5) as conn:
                self.metrics.set_inbox(await self.inspector.inbox_backlog(conn), now)
                self.metrics.set_outbox(await self.outbox.backlog(conn), now)
                self.metrics.set_tables(await self.inspector.table_estimates(conn))
                await conn.rollback()
                self.metrics.set_health(await self.health.check(conn))
            self.metrics.up.set(1)
        except Exception:
            # Metrics must answer even when the database does not: that is what they report.
            self.metrics.up.set(0)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)
