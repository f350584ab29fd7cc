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

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlencode

from pgonce.core.retention import KEYS, HealthReport, format_duration
from pgonce.extras import needs
from pgonce.service.console import charts
from pgonce.service.console.html import HEADERS, body_block, hidden, link, page, status, table, when
from pgonce.store._async.console import (
    PAGE,
    AsyncConsoleReader,
    EventCursor,
    OutboxDetail,
)
from pgonce.store._async.health import AsyncHealthCheck
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store._async.inspect import AsyncInspector, EventDetail, EventSummary, SourceStatus
from pgonce.store._async.outbox import AsyncOutboxStore

with needs("server", "the pgonce service"):
    from psycopg_pool import AsyncConnectionPool
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
    from starlette.routing import Route

STATUSES = ("pending", "done", "dead", "skipped")
OUTBOX_STATES = ("pending", "parked", "published")
#: Most rows one replay form may name (a bulk replay of a whole source has no list).
MAX_SELECTED = 500
#: A form is a few fields; anything longer is not one of ours.
MAX_FORM = 64 * 1024
STATIC = {"console.css": "text/css", "console.js": "text/javascript"}

#: What each health check means and what to do when it is not ok.
CHECK_HELP = {
    "stuck claims": (
        "Claims committed without a response: every retry of such a key is answered 'in flight'.",
        "Find the keys (keys page, or keys_readable WHERE completed_at IS NULL); complete or "
        "release them, and look for the code path that commits between claim and completion.",
    ),
    "oldest row vs retry horizon": (
        "No row may be deleted while its sender may still retry it. The sweeper notes the newest "
        "row it deleted; a young table where nothing that young was deleted is fine.",
        "Give every sweeper (pgonce sweep, pgonce serve) the same retention, at least the retry "
        "horizon of the senders.",
    ),
    "oldest row vs retention": (
        "Rows must not outlive their retention by more than the slack: else the sweeper stalled.",
        "Check that a sweeper runs (pgonce serve's, or a cron of pgonce sweep) and keeps up.",
    ),
    "overdue rows": (
        "Rows past their retention not yet deleted: the sweeper's backlog.",
        "None needed while it shrinks; a growing count means the sweeper cannot keep up.",
    ),
    "sync standby": (
        "With synchronous_standby_names set, whether a standby confirms each commit now.",
        "Bring the standby back (after a failover the old primary must rejoin).",
    ),
}


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


def _html(
    title: str, body: str, *, here: str = "", script: bool = False, code: int = 200
) -> Response:
    return HTMLResponse(
        page(title, body, here=here, script=script), status_code=code, headers=HEADERS
    )


def _event_link(source: str, event_id: str) -> str:
    return link("/admin/event", {"source": source, "id": event_id}, event_id)


def _pair(source: str, event_id: str) -> str:
    """A (source, event id) as one form value: JSON, since a browser rewrites newlines and an
    event id may hold any other separator."""
    return json.dumps([source, event_id])


def _unpair(value: str) -> tuple[str, str] | None:
    try:
        pair = json.loads(value)
    except ValueError:
        return None
    if isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) and p for p in pair):
        return pair[0], pair[1]
    return None


def _int(value: str | None) -> int | None:
    """A row id from a parameter: a positive bigint, else None."""
    try:
        number = int(value) if value else None
    except ValueError:
        return None
    return number if number is not None and 0 < number < 2**63 else None


@dataclass(frozen=True, slots=True)
class _Form:
    """A POSTed urlencoded form, read by the standard library (no python-multipart needed)."""

    fields: dict[str, list[str]]

    def one(self, name: str) -> str:
        return self.fields.get(name, [""])[0]

    def all(self, name: str) -> list[str]:
        return self.fields.get(name, [])


class Admin:
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
    ) -> None:
        self.auth = AdminAuth(token) if token else None
        self.pool = pool
        self.inspector = AsyncInspector(schema=schema)
        self.reader = AsyncConsoleReader(schema=schema)
        self.inbox = AsyncInboxStore(schema=schema)
        self.outbox = AsyncOutboxStore(schema=schema)
        self.health = health
        self.stuck_after = stuck_after
        self.sources = sorted(sources or [])

    def routes(self) -> list[Route]:
        return [
            Route("/admin", self._guard(self.overview)),
            Route("/admin/live", self._guard(self.live)),
            Route("/admin/static/{name}", self._guard(self.static)),
            Route("/admin/keys", self._guard(self.keys)),
            Route("/admin/key", self._guard(self.key)),
            Route("/admin/events", self._guard(self.events)),
            Route("/admin/event", self._guard(self.event)),
            Route("/admin/replay", self._guard(self.replay), methods=["POST"]),
            Route("/admin/outbox", self._guard(self.outbox_rows)),
            Route("/admin/outbox/row", self._guard(self.outbox_row)),
            Route("/admin/outbox/replay", self._guard(self.outbox_replay), methods=["POST"]),
            Route("/admin/health", self._guard(self.health_page)),
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
            if any("\x00" in k or "\x00" in v for k, v in request.query_params.multi_items()):
                # PostgreSQL's text holds no NUL: refused here, not turned into a database error.
                return _html("Bad request", "<p>A parameter holds a NUL character.</p>", code=400)
            return await view(request)

        return guarded

    # ---------------------------------------------------------------------------------------
    # Overview: counts (live), charts.

    async def _counts(self) -> tuple[dict[str, int], list[SourceStatus]]:
        async with self.pool.connection() as conn:
            backlog = await self.inspector.inbox_backlog(conn)
            outbox = await self.outbox.backlog(conn)
            await conn.rollback()
        counts = {"inbox_pending": 0, "inbox_dead": 0}
        for row in backlog:
            counts[f"inbox_{row.status}"] += row.events
        counts.update(
            outbox_pending=outbox.pending,
            outbox_waiting=outbox.waiting,
            outbox_parked=outbox.parked,
        )
        return counts, backlog

    async def live(self, request: Request) -> Response:
        counts, _ = await self._counts()
        return JSONResponse(counts, headers={"cache-control": "no-store"})

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return Response("Not Found", status_code=404, media_type="text/plain")
        data = resources.files("pgonce.service.console").joinpath("static", name).read_bytes()
        return Response(
            data,
            media_type=STATIC[name],
            headers={"cache-control": "max-age=300", "x-content-type-options": "nosniff"},
        )

    async def overview(self, request: Request) -> Response:
        window = charts.WINDOWS.get(request.query_params.get("window", ""), charts.WINDOWS["hour"])
        counts, sources_backlog = await self._counts()
        now = datetime.now(UTC)
        since = now - window.span
        rows: dict[str, list[tuple[Any, ...]]] = {}
        async with self.pool.connection() as conn:
            for name in ("keys", "inbox", "inbox_backlog", "outbox", "outbox_backlog"):
                rows[name] = await self.reader.series(conn, name, since, window.step, window.span)
            stuck = await self.inspector.stuck_claims(conn, self.stuck_after())
            await conn.rollback()
        n = window.buckets
        by_status = {
            s: charts.per_minute(
                charts.fill(((b, c) for b, st, c in rows["inbox"] if st == s), n), window.step
            )
            for s in ("done", "skipped", "pending", "dead")
        }

        def rate(name: str) -> list[float]:
            return charts.per_minute(charts.fill(((b, c) for b, c in rows[name]), n), window.step)

        def backlog(name: str) -> list[float]:
            return [float(v) for v in charts.levels(((b, c) for b, c in rows[name]), n)]

        cards = [
            ("inbox pending", "inbox_pending", "/admin/events?status=pending"),
            ("dead letters", "inbox_dead", "/admin/events?status=dead"),
            ("outbox pending", "outbox_pending", "/admin/outbox?state=pending"),
            ("outbox waiting (backoff)", "outbox_waiting", "/admin/outbox?state=pending"),
            ("outbox parked", "outbox_parked", "/admin/outbox?state=parked"),
        ]
        card_html = "".join(
            f'<div class=card><a href="{href}">{escape(label)}</a>'
            f'<b data-live="{key}">{counts[key]}</b></div>'
            for label, key, href in cards
        )
        switch = " · ".join(
            f"<strong>last {w}</strong>"
            if w == window.name
            else f'<a href="/admin?window={w}">last {w}</a>'
            for w in charts.WINDOWS
        )
        figures = [
            charts.svg("Deliveries by status now", by_status, window),
            charts.svg(
                "Inbox backlog",
                {"backlog": backlog("inbox_backlog")},
                window,
                kind="line",
                unit="events",
            ),
            charts.svg("Outbox rows published", {"rate": rate("outbox")}, window),
            charts.svg(
                "Outbox backlog",
                {"backlog": backlog("outbox_backlog")},
                window,
                kind="line",
                unit="rows",
            ),
            charts.svg("Keys completed (API calls answered)", {"rate": rate("keys")}, window),
        ]
        body = (
            f"<div class=cards>{card_html}</div><p>{switch} <span class=note>(counts refresh every "
            "5 seconds)</span></p>"
            f"<div class=charts>{''.join(figures)}</div>"
            + "<h2>Inbox backlog by source</h2>"
            + table(
                ["source", "status", "events", "oldest"],
                [
                    [
                        escape(row.source),
                        f'<a class="{escape(row.status)}" href="/admin/events?'
                        f'{escape(urlencode({"source": row.source, "status": row.status}))}">'
                        f"{escape(row.status)}</a>",
                        str(row.events),
                        escape(format_duration(now - row.oldest)),
                    ]
                    for row in sources_backlog
                ],
                "no event waits",
            )
            + f"<h2>Stuck claims (older than {escape(format_duration(self.stuck_after()))})</h2>"
            + table(
                ["scope", "key", "claimed at"],
                [
                    [
                        escape(c.scope),
                        link("/admin/key", {"scope": c.scope, "key": c.key}, c.key),
                        when(c.claimed_at),
                    ]
                    for c in stuck
                ],
            )
        )
        return _html("Overview", body, here="/admin", script=True)

    # ---------------------------------------------------------------------------------------
    # Keys: "what did we answer this client?"

    async def keys(self, request: Request) -> Response:
        scope = request.query_params.get("scope", "")
        prefix = request.query_params.get("prefix", "")
        after = request.query_params.get("after", "")
        form = (
            '<form class=filters method="get" action="/admin/keys">'
            f'<label>scope <input name="scope" value="{escape(scope)}" required></label>'
            f'<label>key or key prefix <input name="prefix" value="{escape(prefix)}"></label>'
            "<button type=submit>search</button></form>"
        )
        if not scope:
            note = (
                "<p class=note>Keys are kept per scope: give the scope, and a key or its start.</p>"
            )
            return _html("Keys", form + note, here="/admin/keys")
        async with self.pool.connection() as conn:
            found = await self.reader.keys(conn, scope, prefix, after=after, limit=PAGE + 1)
            exact = await self.reader.key(conn, scope, prefix) if prefix and not after else None
            await conn.rollback()
        more = len(found) > PAGE
        found = found[:PAGE]
        rows = [
            [
                link("/admin/key", {"scope": k.scope, "key": k.key}, k.key),
                status("completed" if k.completed_at else "in flight"),
                "" if k.response_status is None else str(k.response_status),
                when(k.claimed_at),
                when(k.completed_at),
            ]
            for k in found
        ]
        body = form
        if exact is not None:
            body += (
                "<p>"
                + link("/admin/key", {"scope": scope, "key": prefix}, "open key " + prefix)
                + "</p>"
            )
        body += table(["key", "status", "response", "claimed", "completed"], rows, "no keys match")
        if more:
            nxt = {"scope": scope, "prefix": prefix, "after": found[-1].key}
            body += "<p>" + link("/admin/keys", nxt, "next page →") + "</p>"
        return _html("Keys", body, here="/admin/keys")

    async def key(self, request: Request) -> Response:
        scope = request.query_params.get("scope", "")
        key = request.query_params.get("key", "")
        async with self.pool.connection() as conn:
            found = await self.reader.key(conn, scope, key)
            await conn.rollback()
        if found is None:
            return _html(
                "Key not found",
                f"<p>No key {escape(key)} in scope {escape(scope)}.</p>",
                here="/admin/keys",
                code=404,
            )
        policy = next((p for p in self.health.policies if p.target == KEYS.name), None)
        keep = policy.for_scope(scope).keep if policy else None
        expires = found.claimed_at + keep if keep and found.completed_at else None
        facts = [
            ["scope", escape(found.scope)],
            ["key", escape(found.key)],
            ["status", status("completed" if found.completed_at else "in flight")],
            ["request fingerprint (SHA-256)", f"<code>{escape(found.fingerprint)}</code>"],
            ["claimed", when(found.claimed_at)],
            ["completed", when(found.completed_at)],
            [
                "expires (sweeper deletes it after)",
                when(expires) if expires else "never while in flight",
            ],
            [
                "response status",
                "" if found.response_status is None else str(found.response_status),
            ],
        ]
        headers = "\n".join(f"{n}: {v}" for n, v in (found.response_headers or []))
        body = (
            table(["", ""], facts)
            + "<h2>Response headers</h2>"
            + (
                f'<pre class="headers">{escape(headers)}</pre>'
                if found.response_headers
                else "<p><em>none stored</em></p>"
            )
            + body_block(found.response_body, "Response body")
        )
        return _html(f"Key {found.key}", body, here="/admin/keys")

    # ---------------------------------------------------------------------------------------
    # Inbox events and dead letters.

    async def events(self, request: Request) -> Response:
        q = request.query_params
        source = q.get("source") or None
        state = q.get("status") or None
        if state not in STATUSES:
            state = None
        event_id = q.get("id") or None
        after = None
        after_at = q.get("after_at")
        if after_at:
            try:
                after = EventCursor(
                    datetime.fromisoformat(after_at),
                    q.get("after_source", ""),
                    q.get("after_id", ""),
                )
            except ValueError:
                after = None
        async with self.pool.connection() as conn:
            if event_id:
                names = [source] if source else self.sources
                found = await self.reader.event_by_id(conn, names, event_id)
                more = False
            else:
                found = await self._event_page(conn, state, source, after)
                more = len(found) > PAGE
                found = found[:PAGE]
            await conn.rollback()
        known = sorted({*self.sources, *(e.source for e in found), *([source] if source else [])})
        source_options = "".join(
            f'<option value="{escape(s)}"{" selected" if s == (source or "") else ""}>'
            f"{escape(s) or 'any'}</option>"
            for s in ("", *known)
        )
        status_options = "".join(
            f'<option value="{s}"{" selected" if s == (state or "") else ""}>{s or "any"}</option>'
            for s in ("", *STATUSES)
        )
        form = (
            '<form class=filters method="get" action="/admin/events">'
            f'<label>source <select name="source">{source_options}</select></label>'
            f'<label>status <select name="status">{status_options}</select></label>'
            f'<label>event id <input name="id" value="{escape(event_id or "")}"></label>'
            "<button type=submit>filter</button></form>"
        )
        notice = ""
        if q.get("replayed"):
            notice = f"<p class=notice>Replayed {escape(q['replayed'])} event(s).</p>"
        assert self.auth is not None
        rows = []
        for e in found:
            pick = (
                f'<input type="checkbox" name="event" value="{escape(_pair(e.source, e.event_id))}"'
                f' aria-label="select {escape(e.event_id)}">'
                if e.status == "dead"
                else ""
            )
            rows.append(
                [
                    pick,
                    escape(e.source),
                    _event_link(e.source, e.event_id),
                    status(e.status),
                    str(e.attempts),
                    when(e.received_at),
                    when(e.processed_at),
                    escape(e.last_error or ""),
                ]
            )
        listing = table(
            ["", "source", "event id", "status", "attempts", "received", "processed", "last error"],
            rows,
            "no events match",
        )
        if any(e.status == "dead" for e in found):
            listing = (
                '<form method="post" action="/admin/replay">'
                + hidden("csrf", self.auth.csrf)
                + listing
                + "<button type=submit>replay selected</button></form>"
            )
        if source and state == "dead":
            listing += (
                '<form method="post" action="/admin/replay">'
                + hidden("csrf", self.auth.csrf)
                + hidden("all_of", source)
                + f"<button type=submit>replay every dead letter of {escape(source)}</button>"
                + "</form>"
            )
        if more:
            last = found[-1]
            nxt = {k: v for k, v in (("source", source), ("status", state)) if v}
            nxt.update(
                after_at=last.received_at.isoformat(),
                after_source=last.source,
                after_id=last.event_id,
            )
            listing += "<p>" + link("/admin/events", nxt, "older →") + "</p>"
        title = "Dead letters" if state == "dead" else "Events"
        here = "/admin/events?status=dead" if state == "dead" else "/admin/events"
        return _html(title, notice + form + listing, here=here)

    async def _event_page(
        self, conn: Any, state: str | None, source: str | None, after: EventCursor | None
    ) -> list[EventSummary]:
        if state is not None:
            return await self.reader.events(conn, state, source=source, after=after, limit=PAGE + 1)
        # Any status: the first rows of each index path, merged (each is in the same order, so
        # the merge's first rows are the first rows overall).
        merged: list[EventSummary] = []
        for each in ("dead", "pending", "finished"):
            merged += await self.reader.events(
                conn, each, source=source, after=after, limit=PAGE + 1
            )
        merged.sort(key=lambda e: (e.received_at, e.source, e.event_id), reverse=True)
        return merged[: PAGE + 1]

    async def event(self, request: Request) -> Response:
        source = request.query_params.get("source", "")
        event_id = request.query_params.get("id", "")
        async with self.pool.connection() as conn:
            found = await self.inspector.event(conn, source, event_id)
            await conn.rollback()
        if found is None:
            return _html(
                "Event not found",
                f"<p>No event {escape(event_id)} from {escape(source)}.</p>",
                code=404,
            )
        return _html(f"Event {found.event_id}", self._detail(found), here="/admin/events")

    def _detail(self, e: EventDetail) -> str:
        facts = [
            ["source", escape(e.source)],
            ["status", status(e.status)],
            ["attempts (failed runs)", str(e.attempts)],
            ["received", when(e.received_at)],
            ["next attempt", when(e.next_attempt_at) if e.status == "pending" else ""],
            ["processed", when(e.processed_at)],
            ["ordering key", escape(e.ordering_key or "")],
            ["version", "" if e.version is None else str(e.version)],
            ["body SHA-256", f"<code>{escape(e.digest)}</code>"],
            ["last error", f"<pre>{escape(e.last_error)}</pre>" if e.last_error else ""],
        ]
        headers = "\n".join(f"{k}: {v}" for k, v in sorted(e.headers.items()))
        replay = self._replay_button(e.source, e.event_id) if e.status == "dead" else ""
        return (
            table(["", ""], facts)
            + replay
            + f'<h2>Headers as received</h2><pre class="headers">{escape(headers)}</pre>'
            + body_block(e.body, "Body")
        )

    def _replay_button(self, source: str, event_id: str) -> str:
        assert self.auth is not None
        return (
            '<form class="inline" method="post" action="/admin/replay">'
            + hidden("event", _pair(source, event_id))
            + hidden("csrf", self.auth.csrf)
            + "<button type=submit>replay</button></form>"
        )

    async def _form(self, request: Request) -> _Form | Response:
        assert self.auth is not None
        # Another site's page cannot post here: the browser says where the form came from.
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return Response("cross-site form refused", status_code=403, media_type="text/plain")
        raw = await request.body()
        if len(raw) > MAX_FORM:
            return Response("form too large", status_code=413, media_type="text/plain")
        form = _Form(parse_qs(raw.decode("utf-8", "replace")))
        if any("\x00" in v for values in form.fields.values() for v in values):
            return _html("Bad request", "<p>A field holds a NUL character.</p>", code=400)
        if not self.auth.csrf_ok(form.one("csrf")):
            return Response("bad form token", status_code=403, media_type="text/plain")
        return form

    def _confirm(self, action: str, what: str, items: list[str], form: _Form) -> Response:
        """The page that asks before an action: the same fields again, with confirm=yes."""
        assert self.auth is not None
        fields = "".join(
            hidden(name, value)
            for name, values in form.fields.items()
            if name not in ("csrf", "confirm")
            for value in values
        )
        shown = "".join(f"<li>{escape(item)}</li>" for item in items[:50])
        rest = f"<p>and {len(items) - 50} more</p>" if len(items) > 50 else ""
        body = (
            f"<div class=confirm><p>{escape(what)}</p><ul>{shown}</ul>{rest}"
            f'<form method="post" action="{escape(action)}">{fields}'
            + hidden("csrf", self.auth.csrf)
            + hidden("confirm", "yes")
            + "<button type=submit>confirm replay</button></form> "
            '<a href="/admin">cancel</a></div>'
        )
        return _html("Confirm", body)

    async def replay(self, request: Request) -> Response:
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        all_of = form.one("all_of")
        picked: dict[str, list[str]] = {}
        for value in form.all("event")[:MAX_SELECTED]:
            pair = _unpair(value)
            if pair is not None:
                picked.setdefault(pair[0], []).append(pair[1])
        # The form of the first admin page: one event as source and id.
        if not picked and not all_of and form.one("source") and form.one("id"):
            picked[form.one("source")] = [form.one("id")]
        if not picked and not all_of:
            return _html("Nothing to replay", "<p>No dead letter was selected.</p>", code=400)
        if form.one("confirm") != "yes":
            items = (
                [f"every dead letter of {all_of}"]
                if all_of
                else [f"{s} / {i}" for s, ids in picked.items() for i in ids]
            )
            return self._confirm(
                "/admin/replay",
                "Replay these dead letters? Each goes back to pending with a fresh retry budget.",
                items,
                form,
            )
        replayed: list[str] = []
        async with self.pool.connection() as conn, conn.transaction():
            if all_of:
                replayed += await self.inbox.replay(conn, all_of)
            for source, ids in picked.items():
                replayed += await self.inbox.replay(conn, source, ids)
        single = [(s, i) for s, ids in picked.items() for i in ids]
        if len(single) == 1 and not all_of:
            query = urlencode({"source": single[0][0], "id": single[0][1]})
            return RedirectResponse(f"/admin/event?{query}", status_code=303)
        return RedirectResponse(
            f"/admin/events?{urlencode({'status': 'pending', 'replayed': len(replayed)})}",
            status_code=303,
        )

    # ---------------------------------------------------------------------------------------
    # Outbox.

    async def outbox_rows(self, request: Request) -> Response:
        q = request.query_params
        state = q.get("state") or None
        if state not in OUTBOX_STATES:
            state = None
        aggregatetype = q.get("aggregatetype") or None
        aggregateid = q.get("aggregateid") or None
        after = _int(q.get("after"))
        async with self.pool.connection() as conn:
            found = await self.reader.outbox(
                conn,
                state,
                aggregatetype=aggregatetype,
                aggregateid=aggregateid,
                after=after,
                limit=PAGE + 1,
            )
            counts = await self.reader.outbox_counts(conn)
            await conn.rollback()
        more = len(found) > PAGE
        found = found[:PAGE]
        assert self.auth is not None
        state_options = "".join(
            f'<option value="{s}"{" selected" if s == (state or "") else ""}>{s or "any"}</option>'
            for s in ("", *OUTBOX_STATES)
        )
        form = (
            '<form class=filters method="get" action="/admin/outbox">'
            f'<label>state <select name="state">{state_options}</select></label>'
            "<label>aggregate type <input name=aggregatetype "
            f'value="{escape(aggregatetype or "")}"></label>'
            "<label>aggregate id <input name=aggregateid "
            f'value="{escape(aggregateid or "")}"></label>'
            "<button type=submit>filter</button></form>"
        )
        summary = table(
            ["aggregate type", "state", "rows"],
            [
                [link("/admin/outbox", {"state": s, "aggregatetype": a}, a), status(s), str(n)]
                for a, s, n in counts
            ],
            "nothing waits to be published",
        )
        notice = ""
        if q.get("replayed"):
            notice = f"<p class=notice>Replayed {escape(q['replayed'])} parked row(s).</p>"
        rows = [
            [
                f'<input type="checkbox" name="id" value="{r.id}" aria-label="select {r.id}">'
                if r.state == "parked"
                else "",
                link("/admin/outbox/row", {"id": str(r.id)}, str(r.id)),
                escape(r.aggregatetype),
                escape(r.aggregateid),
                escape(r.type),
                status(r.state),
                str(r.attempts),
                when(r.created_at),
                when(r.published_at),
                escape(r.last_error or ""),
            ]
            for r in found
        ]
        listing = table(
            [
                "",
                "id",
                "aggregate type",
                "aggregate id",
                "type",
                "state",
                "attempts",
                "created",
                "published",
                "last error",
            ],
            rows,
            "no rows match",
        )
        if any(r.state == "parked" for r in found):
            listing = (
                '<form method="post" action="/admin/outbox/replay">'
                + hidden("csrf", self.auth.csrf)
                + listing
                + "<button type=submit>replay selected</button></form>"
            )
        if state == "parked" and aggregatetype:
            listing += (
                '<form method="post" action="/admin/outbox/replay">'
                + hidden("csrf", self.auth.csrf)
                + hidden("aggregatetype", aggregatetype)
                + f"<button type=submit>replay every parked row of {escape(aggregatetype)}"
                "</button></form>"
            )
        if more:
            nxt = {
                k: v
                for k, v in (
                    ("state", state),
                    ("aggregatetype", aggregatetype),
                    ("aggregateid", aggregateid),
                )
                if v
            }
            nxt["after"] = str(found[-1].id)
            listing += "<p>" + link("/admin/outbox", nxt, "older →") + "</p>"
        body = notice + "<h2>Waiting to be published</h2>" + summary + form + listing
        return _html("Outbox", body, here="/admin/outbox")

    async def outbox_row(self, request: Request) -> Response:
        row_id = _int(request.query_params.get("id"))
        found: OutboxDetail | None = None
        if row_id is not None:
            async with self.pool.connection() as conn:
                found = await self.reader.outbox_row(conn, row_id)
                await conn.rollback()
        if found is None:
            return _html(
                "Outbox row not found", "<p>No such outbox row.</p>", code=404, here="/admin/outbox"
            )
        assert self.auth is not None
        facts = [
            ["id (message id on every broker)", str(found.id)],
            ["aggregate", escape(f"{found.aggregatetype} / {found.aggregateid}")],
            ["type", escape(found.type)],
            ["state", status(found.state)],
            ["attempts (refused deliveries)", str(found.attempts)],
            ["created", when(found.created_at)],
            [
                "next attempt",
                when(found.next_attempt_at) if found.state in ("pending", "waiting") else "",
            ],
            ["published", when(found.published_at)],
            ["parked", when(found.parked_at)],
            ["last error", f"<pre>{escape(found.last_error)}</pre>" if found.last_error else ""],
        ]
        replay = ""
        if found.state == "parked":
            replay = (
                '<form class="inline" method="post" action="/admin/outbox/replay">'
                + hidden("id", str(found.id))
                + hidden("csrf", self.auth.csrf)
                + "<button type=submit>replay</button></form>"
            )
        body = (
            table(["", ""], facts)
            + replay
            + f'<h2>Headers</h2><pre class="headers">{escape(found.headers)}</pre>'
            + body_block(found.payload.encode(), "Payload")
        )
        return _html(f"Outbox row {found.id}", body, here="/admin/outbox")

    async def outbox_replay(self, request: Request) -> Response:
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        ids = [i for i in (_int(v) for v in form.all("id")[:MAX_SELECTED]) if i is not None]
        aggregatetype = form.one("aggregatetype") or None
        if not ids and not aggregatetype:
            return _html("Nothing to replay", "<p>No parked row was selected.</p>", code=400)
        if form.one("confirm") != "yes":
            items = (
                [f"every parked row of {aggregatetype}"]
                if aggregatetype
                else [f"outbox row {i}" for i in ids]
            )
            return self._confirm(
                "/admin/outbox/replay",
                "Replay these parked rows? Each is due at once with its attempts reset.",
                items,
                form,
            )
        async with self.pool.connection() as conn, conn.transaction():
            if aggregatetype:
                replayed = await self.outbox.replay(conn, aggregatetype=aggregatetype)
            else:
                replayed = await self.outbox.replay(conn, ids=ids)
        if len(ids) == 1 and not aggregatetype:
            return RedirectResponse(f"/admin/outbox/row?id={ids[0]}", status_code=303)
        return RedirectResponse(f"/admin/outbox?replayed={len(replayed)}", status_code=303)

    # ---------------------------------------------------------------------------------------
    # Health.

    async def health_page(self, request: Request) -> Response:
        async with self.pool.connection() as conn:
            report = await self.health.check(conn)
            marks = await self.reader.sweep_marks(conn)
            await conn.rollback()
        now = datetime.now(UTC)
        body = (
            f"<p>Overall: {status(report.status)}</p>"
            + self._health_table(report)
            + "<h2>What the sweeper deleted</h2>"
            + table(
                [
                    "target",
                    "scope",
                    "rows deleted",
                    "newest row deleted (its age now)",
                    "last batch",
                ],
                [
                    [
                        escape(m.target),
                        escape(m.scope or "—"),
                        f"{m.deleted:,}",
                        f"{when(m.newest)} ({escape(format_duration(now - m.newest))})",
                        when(m.swept_at),
                    ]
                    for m in marks
                ],
                "nothing deleted yet",
            )
        )
        return _html("Health", body, here="/admin/health")

    @staticmethod
    def _health_table(report: HealthReport) -> str:
        rows = []
        for f in report.findings:
            meaning, fix = CHECK_HELP.get(f.check, ("", ""))
            rows.append(
                [
                    escape(f.check),
                    escape(f.target + (f" ({f.scope})" if f.scope else "")),
                    status(f.status),
                    escape(f.value),
                    escape(f.limit),
                    escape(f.detail or meaning),
                    escape(fix) if f.status != "ok" else "",
                ]
            )
        return table(["check", "target", "status", "value", "limit", "meaning", "fix"], rows)
