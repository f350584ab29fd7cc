"""The operator console: server-rendered pages at ``/admin``, no build step, no CDN.

Pages: the overview (live counts, rates and backlogs drawn from the database by time buckets),
keys (search by scope and key prefix; a key's fingerprint, status and stored response), inbox
events and dead letters (filters, detail, replay of one or many), the outbox (filters, detail,
replay of parked rows) and health (each check with its meaning and its fix). Every listing pages
by keyset, and every query reads an index range (``queries/console.sql``).

Closed unless configured: without ``[admin] token`` every ``/admin`` URL answers 404, so no admin
surface exists on a network port by accident. With a token, every request must present it as the
password of HTTP Basic authentication (any user name), compared in constant time. Every action is
a POST carrying a token derived from the admin token (CSRF), refused from another site's page, and
asks for a confirmation before it changes anything. Every page is sent with a strict
Content-Security-Policy (no inline script or style) and every value is escaped.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from pgonce import sql as pgsql
from pgonce.errors import DatabaseError
from pgonce.extras import needs
from pgonce.service.console.base import AdminAuth, respond
from pgonce.service.console.inbox import InboxPages
from pgonce.service.console.outbox import OutboxPages
from pgonce.store._async.console import AsyncConsoleReader
from pgonce.store._async.health import AsyncHealthCheck
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store._async.inspect import AsyncInspector
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store.errors import first_line

with needs("server", "the pgonce service"):
    from psycopg_pool import AsyncConnectionPool
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

from pgonce.service.console.health import HealthPages
from pgonce.service.console.keys import KeyPages
from pgonce.service.console.overview import OverviewPages

__all__ = ["Admin", "AdminAuth"]

log = logging.getLogger("pgonce.service")

#: When a console page that found the database away says to look again, in seconds.
RETRY_AFTER_SECONDS = 5


class Admin(OverviewPages, KeyPages, InboxPages, OutboxPages, HealthPages):
    """The console's routes, bound to the service's pool and stores."""

    def __init__(
        self,
        token: str | None,
        pool: AsyncConnectionPool[Any],
        *,
        schema: str,
        health: AsyncHealthCheck,
        stuck_after: Callable[[], Any],
        sources: list[str] | None = None,
        answered: Callable[[], list[tuple[str, str, int]]] = list,
    ) -> None:
        self.auth = AdminAuth(token) if token else None
        self.pool = pool
        self.inspector = AsyncInspector(schema=schema)
        self.reader = AsyncConsoleReader(schema=schema)
        self.inbox = AsyncInboxStore(schema=schema)
        self.outbox = AsyncOutboxStore(schema=schema)
        self.health = health
        self.statement_timeout = pgsql.Queries("sweep", schema).statement_timeout
        self.stuck_after = stuck_after
        self.sources = sorted(sources or [])
        self.answered = answered

    def routes(self) -> list[Route]:
        # Every route takes every method and the guard answers first: without a token no admin
        # URL answers anything but 404 (no 405, no slash redirect that would show it exists).
        get = ("GET", "HEAD")
        views: list[tuple[str, Callable[[Request], Awaitable[Response]], tuple[str, ...]]] = [
            ("/admin", self.overview, get),
            ("/admin/live", self.live, get),
            ("/admin/static/{name}", self.static, get),
            ("/admin/keys", self.keys, get),
            ("/admin/key", self.key, get),
            ("/admin/events", self.events, get),
            ("/admin/event", self.event, get),
            ("/admin/replay", self.replay, ("POST",)),
            ("/admin/outbox", self.outbox_rows, get),
            ("/admin/outbox/row", self.outbox_row, get),
            ("/admin/outbox/replay", self.outbox_replay, ("POST",)),
            ("/admin/health", self.health_page, get),
            ("/admin/{rest:path}", self.not_found, get),
        ]
        every = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
        return [
            Route(path, self._guard(view, allowed), methods=every) for path, view, allowed in views
        ]

    async def not_found(self, request: Request) -> Response:
        return respond("Not found", "<p>No such console page.</p>", code=404)

    def _guard(
        self, view: Callable[[Request], Awaitable[Response]], methods: tuple[str, ...]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            if self.auth is None:
                return Response("Not Found", status_code=404, media_type="text/plain")
            if not self.auth.allows(request):
                return Response(
                    "The admin page needs the admin token as the password.",
                    status_code=401,
                    headers={"www-authenticate": 'Basic realm="pgonce admin", charset="UTF-8"'},
                    media_type="text/plain",
                )
            if request.method not in methods:
                return Response(
                    "Method Not Allowed",
                    status_code=405,
                    headers={"allow": ", ".join(methods)},
                    media_type="text/plain",
                )
            if any("\x00" in k or "\x00" in v for k, v in request.query_params.multi_items()):
                # PostgreSQL's text holds no NUL: refused here, not turned into a database error.
                return respond("Bad request", "<p>A parameter holds a NUL character.</p>", code=400)
            try:
                return await view(request)
            except (DatabaseError, psycopg.OperationalError) as error:
                # The database away, the pool busy for its whole wait, a statement cut by its
                # timeout: the page is unavailable for now, not broken (a bare 500 and a stack).
                log.warning(
                    "admin page %s could not reach the database: %s: %s",
                    request.url.path,
                    type(error).__name__,
                    first_line(error),
                )
                answer = respond(
                    "Database unavailable",
                    # Not "nothing was changed": a connection lost during a replay's COMMIT
                    # leaves that unknown, and the page that lists the rows says what happened.
                    "<p>The database could not be reached or did not answer in time. Try again "
                    "in a few seconds.</p>",
                    code=503,
                )
                answer.headers["retry-after"] = str(RETRY_AFTER_SECONDS)
                return answer

        return guarded
