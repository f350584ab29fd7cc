"""What the console's pages share: the guard's token, the response, forms and their confirmation."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any
from urllib.parse import parse_qs

from pgonce.core.frozen import refuse_changes
from pgonce.extras import needs
from pgonce.service.console.html import HEADERS, hidden, link, page
from pgonce.store._async.console import AsyncConsoleReader
from pgonce.store._async.health import AsyncHealthCheck
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store._async.inspect import AsyncInspector
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store.cursors import cursor

with needs("server", "the pgonce service"):
    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, Response


STATUSES = ("pending", "done", "dead", "skipped")
OUTBOX_STATES = ("pending", "parked", "published")
#: Most rows one replay form may name (a bulk replay of a whole source has no list).
MAX_SELECTED = 500
#: A form is a few fields; anything longer is not one of ours.
MAX_FORM = 64 * 1024
STATIC = {"console.css": "text/css", "console.js": "text/javascript"}
#: The server's bound on each transaction's statements of a console page (SET LOCAL
#: statement_timeout, which counts lock waits too), as for /readyz: a table locked by a migration
#: answers 503 within it. Unbounded, each page held its pooled connection for as long as the lock
#: lasted, and an open console polling /admin/live took the pool from the webhook deliveries.
CONSOLE_STATEMENT_MS = 5000


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


def respond(
    title: str, body: str, *, here: str = "", script: bool = False, code: int = 200
) -> Response:
    return HTMLResponse(
        page(title, body, here=here, script=script), status_code=code, headers=HEADERS
    )


def event_link(source: str, event_id: str) -> str:
    return link("/admin/event", {"source": source, "id": event_id}, event_id)


def pair(source: str, event_id: str) -> str:
    """A (source, event id) as one form value: JSON, since a browser rewrites newlines and an
    event id may hold any other separator."""
    return json.dumps([source, event_id])


def unpair(value: str) -> tuple[str, str] | None:
    try:
        pair = json.loads(value)
    except ValueError:
        return None
    if isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) and p for p in pair):
        return pair[0], pair[1]
    return None


def as_row_id(value: str | None) -> int | None:
    """A row id from a parameter: a positive bigint, else None."""
    try:
        number = int(value) if value else None
    except ValueError:
        return None
    return number if number is not None and 0 < number < 2**63 else None


@refuse_changes
@dataclass(frozen=True, slots=True)
class Form:
    """A POSTed urlencoded form, read by the standard library (no python-multipart needed)."""

    fields: dict[str, list[str]]

    def one(self, name: str) -> str:
        return self.fields.get(name, [""])[0]

    def all(self, name: str) -> list[str]:
        return self.fields.get(name, [])


class ConsoleBase:
    """What every page needs: the pool, the stores, the form and its confirmation."""

    auth: AdminAuth | None
    pool: AsyncConnectionPool[Any]
    inspector: AsyncInspector
    reader: AsyncConsoleReader
    inbox: AsyncInboxStore
    outbox: AsyncOutboxStore
    health: AsyncHealthCheck
    stuck_after: Callable[[], Any]
    sources: list[str]
    #: Webhook deliveries this process answered, as (source, outcome, count): duplicates are
    #: answers, not rows, so only the process counts them.
    answered: Callable[[], list[tuple[str, str, int]]]
    #: The statement that sets statement_timeout for the rest of the transaction.
    statement_timeout: bytes

    async def _bounded(self, conn: AsyncConnection[Any]) -> None:
        """Bound the statements of ``conn``'s transaction by :data:`CONSOLE_STATEMENT_MS`: the
        first statement of each transaction a page runs (inside ``conn.transaction()`` where a
        page writes, so that the block is the transaction and commits)."""
        await cursor(conn).execute(
            self.statement_timeout, {"timeout_ms": str(CONSOLE_STATEMENT_MS)}
        )

    async def _form(self, request: Request) -> Form | Response:
        assert self.auth is not None
        # Another site's page cannot post here: the browser says where the form came from.
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return Response("cross-site form refused", status_code=403, media_type="text/plain")
        # Refused before it is read, and while it is read: awaiting the whole body first held
        # a request that declared a gigabyte open for it, and any body sent in memory.
        declared = request.headers.get("content-length", "")
        too_large = Response("form too large", status_code=413, media_type="text/plain")
        if declared.isdigit() and int(declared) > MAX_FORM:
            return too_large
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_FORM:
                return too_large
        form = Form(parse_qs(raw.decode("utf-8", "replace")))
        if any("\x00" in v for values in form.fields.values() for v in values):
            return respond("Bad request", "<p>A field holds a NUL character.</p>", code=400)
        if not self.auth.csrf_ok(form.one("csrf")):
            return Response("bad form token", status_code=403, media_type="text/plain")
        return form

    def _confirm(self, action: str, what: str, items: list[str], form: Form) -> Response:
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
        return respond("Confirm", body)
