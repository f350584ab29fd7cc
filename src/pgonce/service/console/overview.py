"""Overview: live counts, and rates and backlogs drawn from time buckets."""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from pgonce.core.retention import format_duration
from pgonce.extras import needs
from pgonce.service.console import charts
from pgonce.service.console.base import (
    STATIC,
    ConsoleBase,
    respond,
)
from pgonce.service.console.html import link, status, table, when
from pgonce.store._async.inspect import SourceStatus

with needs("server", "the pgonce service"):
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response


class OverviewPages(ConsoleBase):
    """The overview pages."""

    async def _counts(self) -> tuple[dict[str, int], list[SourceStatus]]:
        async with self.pool.connection() as conn:
            await self._bounded(conn)
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
            await self._bounded(conn)
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
            + "<h2>Webhook deliveries answered since this process started</h2>"
            + table(
                ["source", "outcome", "deliveries"],
                [[escape(src), status(outcome), str(n)] for src, outcome, n in self.answered()],
                "none yet",
            )
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
        return respond("Overview", body, here="/admin", script=True)
