"""Keys: "what did we answer this client?", by scope and key prefix."""

from __future__ import annotations

from html import escape

from pgonce.core.retention import KEYS
from pgonce.extras import needs
from pgonce.service.console.base import (
    ConsoleBase,
    respond,
)
from pgonce.service.console.html import body_block, link, status, table, when
from pgonce.store._async.console import PAGE

with needs("server", "the pgonce service"):
    from starlette.requests import Request
    from starlette.responses import Response


class KeyPages(ConsoleBase):
    """The keys pages."""

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
            return respond("Keys", form + note, here="/admin/keys")
        async with self.pool.connection() as conn:
            await self._bounded(conn)
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
        return respond("Keys", body, here="/admin/keys")

    async def key(self, request: Request) -> Response:
        scope = request.query_params.get("scope", "")
        key = request.query_params.get("key", "")
        async with self.pool.connection() as conn:
            await self._bounded(conn)
            found = await self.reader.key(conn, scope, key)
            await conn.rollback()
        if found is None:
            return respond(
                "Key not found",
                f"<p>No key {escape(key)} in scope {escape(scope)}.</p>",
                here="/admin/keys",
                code=404,
            )
        policy = next((p for p in self.health.policies if p.target == KEYS.name), None)
        keep = policy.for_scope(scope).keep if policy else None
        expires = found.completed_at + keep if keep and found.completed_at else None
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
        return respond(f"Key {found.key}", body, here="/admin/keys")
