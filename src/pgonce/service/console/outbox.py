"""The outbox: filters, a row's detail, replay of parked rows."""

from __future__ import annotations

from html import escape

from pgonce.extras import needs
from pgonce.service.console.base import (
    MAX_SELECTED,
    OUTBOX_STATES,
    ConsoleBase,
    as_row_id,
    respond,
)
from pgonce.service.console.html import body_block, hidden, link, status, table, when
from pgonce.store._async.console import (
    PAGE,
    OutboxDetail,
)

with needs("server", "the pgonce service"):
    from starlette.requests import Request
    from starlette.responses import RedirectResponse, Response


class OutboxPages(ConsoleBase):
    """The outbox pages."""

    async def outbox_rows(self, request: Request) -> Response:
        q = request.query_params
        state = q.get("state") or None
        if state not in OUTBOX_STATES:
            state = None
        aggregatetype = q.get("aggregatetype") or None
        aggregateid = q.get("aggregateid") or None
        after = as_row_id(q.get("after"))
        async with self.pool.connection() as conn:
            await self._bounded(conn)
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
        if q.get("replayed", "").isdigit():
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
        return respond("Outbox", body, here="/admin/outbox")

    async def outbox_row(self, request: Request) -> Response:
        row_id = as_row_id(request.query_params.get("id"))
        found: OutboxDetail | None = None
        if row_id is not None:
            async with self.pool.connection() as conn:
                await self._bounded(conn)
                found = await self.reader.outbox_row(conn, row_id)
                await conn.rollback()
        if found is None:
            return respond(
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
        return respond(f"Outbox row {found.id}", body, here="/admin/outbox")

    async def outbox_replay(self, request: Request) -> Response:
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        ids = [i for i in (as_row_id(v) for v in form.all("id")[:MAX_SELECTED]) if i is not None]
        aggregatetype = form.one("aggregatetype") or None
        if not ids and not aggregatetype:
            return respond("Nothing to replay", "<p>No parked row was selected.</p>", code=400)
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
            await self._bounded(conn)
            if aggregatetype:
                replayed = await self.outbox.replay(conn, aggregatetype=aggregatetype)
            else:
                replayed = await self.outbox.replay(conn, ids=ids)
        if len(ids) == 1 and not aggregatetype:
            return RedirectResponse(f"/admin/outbox/row?id={ids[0]}", status_code=303)
        return RedirectResponse(f"/admin/outbox?replayed={len(replayed)}", status_code=303)
