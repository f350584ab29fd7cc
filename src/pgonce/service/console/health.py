"""Health: each check with its meaning and its fix, and what the sweeper deleted."""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape

from pgonce.core.retention import HealthReport, format_duration
from pgonce.extras import needs
from pgonce.service.console.base import (
    ConsoleBase,
    respond,
)
from pgonce.service.console.html import status, table, when

with needs("server", "the pgonce service"):
    from starlette.requests import Request
    from starlette.responses import Response


#: What each health check means and what to do when it is not ok.
CHECK_HELP = {
    "stuck claims": (
        "Claims committed without a response: every retry of such a key is answered 'in flight'.",
        "Find the keys (keys page, or keys_readable WHERE completed_at IS NULL); complete or "
        "release them, and look for the code path that commits between claim and completion.",
    ),
    "retired requests": (
        "Two-phase requests whose holders kept failing: the completer stored a 500 problem "
        "answer that every retry replays. A warning while one is recent; counted until swept.",
        "Look at each (pgonce.key_leases WHERE locked_until = 'infinity': its recovery point, "
        "attempts and last error); a phase past a third party's call may have acted there, so "
        "settle it with the customer (a refund, a manual completion).",
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


class HealthPages(ConsoleBase):
    """The health pages."""

    async def health_page(self, request: Request) -> Response:
        async with self.pool.connection() as conn:
            await self._bounded(conn)
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
        return respond("Health", body, here="/admin/health")

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
