"""The admin page: server-rendered HTML at ``/admin``, no build step, no JavaScript required.

It shows stored events (filters by source, status and id; the detail of one event: headers, body,
attempts, last error), dead letters with a replay button, stuck claims, the retention horizon and
the outbox lag.

Closed unless configured: without ``[admin] token`` every ``/admin`` URL answers 404, so no admin
surface exists on a network port by accident. With a token, every request must present it as the
password of HTTP Basic authentication (any user name), compared in constant time. The replay form
carries a token derived from the admin token, so another site cannot make a logged-in browser
replay events (CSRF).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import parse_qs, urlencode

from pgonce.core.retention import HealthReport, format_duration
from pgonce.extras import needs
from pgonce.store._async.health import AsyncHealthCheck
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store._async.inspect import AsyncInspector, EventDetail
from pgonce.store._async.outbox import AsyncOutboxStore

with needs("server", "the pgonce service"):
    from psycopg_pool import AsyncConnectionPool
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, RedirectResponse, Response
    from starlette.routing import Route

#: Bytes of a body shown on the detail page; the rest is counted, not shown.
BODY_PREVIEW = 64 * 1024
STATUSES = ("pending", "done", "dead", "skipped")

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 20px}header a{color:#fff;margin-right:16px}
main{padding:16px 20px}table{border-collapse:collapse;background:#fff;margin:8px 0 20px}
td,th{border:1px solid #d8dce3;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef0f4}.ok{color:#17803d}.warn{color:#a15c00}.fail,.dead{color:#b42318}
pre{background:#fff;border:1px solid #d8dce3;padding:8px;overflow:auto;max-height:30em}
form.inline{display:inline}button{cursor:pointer}
"""


class AdminAuth:
    """HTTP Basic with the admin token as password; constant-time comparison."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self.csrf = hmac.new(self._token, b"pgonce-admin-replay", hashlib.sha256).hexdigest()

    def allows(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            decoded = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            return False
        _, _, password = decoded.partition(b":")
        return hmac.compare_digest(password, self._token)

    def csrf_ok(self, value: str) -> bool:
        return hmac.compare_digest(value.encode(), self.csrf.encode())


def _page(title: str, body: str) -> HTMLResponse:
    html = (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{escape(title)} · pgonce"
        f"</title><style>{STYLE}</style></head><body><header><strong>pgonce</strong> &nbsp; "
        '<a href="/admin">overview</a><a href="/admin/events">events</a>'
        '<a href="/admin/events?status=dead">dead letters</a></header>'
        f"<main><h1>{escape(title)}</h1>{body}</main></body></html>"
    )
    return HTMLResponse(html, headers={"cache-control": "no-store"})


def _table(headings: list[str], rows: list[list[str]], empty: str = "none") -> str:
    if not rows:
        return f"<p><em>{escape(empty)}</em></p>"
    # Headings all empty: a table of facts (label, value), drawn without an empty heading row.
    head = "".join(f"<th>{escape(h)}</th>" for h in headings) if any(headings) else ""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table>{f'<tr>{head}</tr>' if head else ''}{body}</table>"


def _when(value: datetime | None) -> str:
    return escape(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")) if value else ""


def _event_link(source: str, event_id: str) -> str:
    query = urlencode({"source": source, "id": event_id})
    return f'<a href="/admin/event?{escape(query)}">{escape(event_id)}</a>'


class Admin:
    """The admin routes, bound to the service's pool and stores."""

    def __init__(
        self,
        token: str | None,
        pool: AsyncConnectionPool[Any],
        *,
        schema: str,
        health: AsyncHealthCheck,
        stuck_after: Callable[[], Any],
    ) -> None:
        self.auth = AdminAuth(token) if token else None
        self.pool = pool
        self.inspector = AsyncInspector(schema=schema)
        self.inbox = AsyncInboxStore(schema=schema)
        self.outbox = AsyncOutboxStore(schema=schema)
        self.health = health
        self.stuck_after = stuck_after

    def routes(self) -> list[Route]:
        return [
            Route("/admin", self._guard(self.overview)),
            Route("/admin/events", self._guard(self.events)),
            Route("/admin/event", self._guard(self.event)),
            Route("/admin/replay", self._guard(self.replay), methods=["POST"]),
        ]

    def _guard(
        self, view: Callable[[Request], Awaitable[Response]]
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
            return await view(request)

        return guarded

    async def overview(self, request: Request) -> Response:
        now = datetime.now(UTC)
        async with self.pool.connection() as conn:
            overview = await self.inspector.inbox_overview(conn)
            outbox = await self.outbox.counts(conn)
            stuck = await self.inspector.stuck_claims(conn, self.stuck_after())
            await conn.rollback()
            report = await self.health.check(conn)
        inbox_rows = [
            [
                escape(row.source),
                f'<a class="{escape(row.status)}" href="/admin/events?'
                f'{escape(urlencode({"source": row.source, "status": row.status}))}">'
                f"{escape(row.status)}</a>",
                str(row.events),
                escape(format_duration(now - row.oldest)) if row.status == "pending" else "",
            ]
            for row in overview
        ]
        lag = format_duration(now - outbox.oldest_pending) if outbox.oldest_pending else "none"
        body = (
            "<h2>Inbox</h2>"
            + _table(["source", "status", "events", "oldest pending"], inbox_rows, "no events yet")
            + "<h2>Outbox</h2>"
            + _table(
                ["pending", "waiting (backoff)", "parked", "published", "lag"],
                [
                    [
                        str(outbox.pending),
                        str(outbox.waiting),
                        str(outbox.parked),
                        str(outbox.published),
                        escape(lag),
                    ]
                ],
            )
            + "<h2>Health</h2>"
            + self._health_table(report)
            + f"<h2>Stuck claims (older than {escape(format_duration(self.stuck_after()))})</h2>"
            + _table(
                ["scope", "key", "claimed at"],
                [[escape(c.scope), escape(c.key), _when(c.claimed_at)] for c in stuck],
            )
        )
        return _page("Overview", body)

    @staticmethod
    def _health_table(report: HealthReport) -> str:
        rows = [
            [
                escape(f.check),
                escape(f.target + (f" ({f.scope})" if f.scope else "")),
                f'<span class="{escape(f.status)}">{escape(f.status)}</span>',
                escape(f.value),
                escape(f.limit),
                escape(f.detail),
            ]
            for f in report.findings
        ]
        return _table(["check", "target", "status", "value", "limit", "detail"], rows)

    async def events(self, request: Request) -> Response:
        source = request.query_params.get("source") or None
        status = request.query_params.get("status") or None
        event_id = request.query_params.get("id") or None
        async with self.pool.connection() as conn:
            found = await self.inspector.events(
                conn, source=source, status=status, event_id=event_id, limit=200
            )
        options = "".join(
            f'<option value="{s}"{" selected" if s == status else ""}>{s or "any"}</option>'
            for s in ("", *STATUSES)
        )
        form = (
            '<form method="get" action="/admin/events">'
            f'source <input name="source" value="{escape(source or "")}"> '
            f'status <select name="status">{options}</select> '
            f'id <input name="id" value="{escape(event_id or "")}"> '
            "<button type=submit>filter</button></form>"
        )
        rows = []
        for e in found:
            action = self._replay_button(e.source, e.event_id) if e.status == "dead" else ""
            rows.append(
                [
                    escape(e.source),
                    _event_link(e.source, e.event_id),
                    f'<span class="{escape(e.status)}">{escape(e.status)}</span>',
                    str(e.attempts),
                    _when(e.received_at),
                    _when(e.processed_at),
                    escape(e.last_error or ""),
                    action,
                ]
            )
        table = _table(
            ["source", "event id", "status", "attempts", "received", "processed", "last error", ""],
            rows,
            "no events match",
        )
        return _page("Events", form + table)

    def _replay_button(self, source: str, event_id: str) -> str:
        assert self.auth is not None
        return (
            '<form class="inline" method="post" action="/admin/replay">'
            f'<input type="hidden" name="source" value="{escape(source)}">'
            f'<input type="hidden" name="id" value="{escape(event_id)}">'
            f'<input type="hidden" name="csrf" value="{self.auth.csrf}">'
            "<button type=submit>replay</button></form>"
        )

    async def event(self, request: Request) -> Response:
        source = request.query_params.get("source", "")
        event_id = request.query_params.get("id", "")
        async with self.pool.connection() as conn:
            found = await self.inspector.event(conn, source, event_id)
        if found is None:
            return _page(
                "Event not found", f"<p>No event {escape(event_id)} from {escape(source)}.</p>"
            )
        return _page(f"Event {found.event_id}", self._detail(found))

    def _detail(self, e: EventDetail) -> str:
        facts = [
            ["source", escape(e.source)],
            ["status", f'<span class="{escape(e.status)}">{escape(e.status)}</span>'],
            ["attempts", str(e.attempts)],
            ["received", _when(e.received_at)],
            ["next attempt", _when(e.next_attempt_at) if e.status == "pending" else ""],
            ["processed", _when(e.processed_at)],
            ["ordering key", escape(e.ordering_key or "")],
            ["version", "" if e.version is None else str(e.version)],
            ["body SHA-256", escape(e.digest)],
            ["last error", f"<pre>{escape(e.last_error)}</pre>" if e.last_error else ""],
        ]
        text = e.body[:BODY_PREVIEW].decode("utf-8", "replace")
        more = len(e.body) - BODY_PREVIEW
        headers = "\n".join(f"{k}: {v}" for k, v in sorted(e.headers.items()))
        replay = self._replay_button(e.source, e.event_id) if e.status == "dead" else ""
        return (
            _table(["", ""], facts)
            + replay
            + f"<h2>Headers</h2><pre>{escape(headers)}</pre>"
            + f"<h2>Body ({len(e.body)} bytes)</h2><pre>{escape(text)}</pre>"
            + (f"<p>{more} more bytes not shown</p>" if more > 0 else "")
        )

    async def replay(self, request: Request) -> Response:
        assert self.auth is not None
        # A urlencoded form of three fields: the standard library reads it (Starlette's form
        # parser would need python-multipart for nothing more).
        form = parse_qs((await request.body())[:8192].decode("utf-8", "replace"))
        source, event_id, csrf = (form.get(k, [""])[0] for k in ("source", "id", "csrf"))
        if not self.auth.csrf_ok(csrf):
            return Response("bad form token", status_code=403, media_type="text/plain")
        async with self.pool.connection() as conn, conn.transaction():
            await self.inbox.replay(conn, source, [event_id])
        query = urlencode({"source": source, "id": event_id})
        return RedirectResponse(f"/admin/event?{query}", status_code=303)
