"""Inbox events and dead letters: filters, detail, replay of one or many."""

from __future__ import annotations

from datetime import datetime
from html import escape
from typing import Any
from urllib.parse import urlencode

from pgonce.extras import needs
from pgonce.service.console.base import (
    MAX_SELECTED,
    STATUSES,
    ConsoleBase,
    event_link,
    pair,
    respond,
    unpair,
)
from pgonce.service.console.html import body_block, hidden, link, status, table, when
from pgonce.store._async.console import (
    PAGE,
    EventCursor,
)
from pgonce.store._async.inspect import EventDetail, EventSummary

with needs("server", "the pgonce service"):
    from starlette.requests import Request
    from starlette.responses import RedirectResponse, Response


class InboxPages(ConsoleBase):
    """The inbox pages."""

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
            await self._bounded(conn)
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
        if q.get("replayed", "").isdigit():
            notice = f"<p class=notice>Replayed {escape(q['replayed'])} event(s).</p>"
        assert self.auth is not None
        rows = []
        for e in found:
            pick = (
                f'<input type="checkbox" name="event" value="{escape(pair(e.source, e.event_id))}"'
                f' aria-label="select {escape(e.event_id)}">'
                if e.status == "dead"
                else ""
            )
            rows.append(
                [
                    pick,
                    escape(e.source),
                    event_link(e.source, e.event_id),
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
        return respond(title, notice + form + listing, here=here)

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
            await self._bounded(conn)
            found = await self.inspector.event(conn, source, event_id)
            await conn.rollback()
        if found is None:
            return respond(
                "Event not found",
                f"<p>No event {escape(event_id)} from {escape(source)}.</p>",
                code=404,
            )
        return respond(f"Event {found.event_id}", self._detail(found), here="/admin/events")

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
            + hidden("event", pair(source, event_id))
            + hidden("csrf", self.auth.csrf)
            + "<button type=submit>replay</button></form>"
        )

    async def replay(self, request: Request) -> Response:
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        all_of = form.one("all_of")
        picked: dict[str, list[str]] = {}
        for value in form.all("event")[:MAX_SELECTED]:
            chosen = unpair(value)
            if chosen is not None:
                picked.setdefault(chosen[0], []).append(chosen[1])
        # The form of the first admin page: one event as source and id.
        if not picked and not all_of and form.one("source") and form.one("id"):
            picked[form.one("source")] = [form.one("id")]
        if not picked and not all_of:
            return respond("Nothing to replay", "<p>No dead letter was selected.</p>", code=400)
        if picked and all_of:
            # The confirmation lists what will be replayed: one form, one kind of choice.
            return respond(
                "Choose one kind of replay",
                "<p>The form asked for every dead letter of a source and for single events at "
                "once; replay either a whole source or the selected events.</p>",
                code=400,
            )
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
            await self._bounded(conn)
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
