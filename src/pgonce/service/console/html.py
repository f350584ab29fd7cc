"""The console's HTML: one page shell, escaping helpers, and bodies rendered inert.

Every value that comes from the database or the request goes through :func:`html.escape` before it
reaches a page; the helpers here take already-escaped cells (``Cell``) only where the caller built
the markup itself. Bodies (a stored response, a delivery's payload) are never HTML: they are shown
as text in ``<pre>``, or as indented JSON when they parse as JSON, with bytes that are not UTF-8
shown as ``\\xNN`` escapes. A page's Content-Security-Policy forbids inline scripts and styles,
so even markup that slipped through could not run.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from html import escape
from urllib.parse import urlencode

#: Bytes of a body shown on a detail page; the rest is counted, not shown.
BODY_PREVIEW = 64 * 1024

#: No inline script or style, nothing from another origin, no framing, forms post here only.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}

NAV = (
    ("/admin", "overview"),
    ("/admin/keys", "keys"),
    ("/admin/events", "events"),
    ("/admin/events?status=dead", "dead letters"),
    ("/admin/outbox", "outbox"),
    ("/admin/health", "health"),
)


def page(title: str, body: str, *, here: str = "", script: bool = False) -> str:
    """A whole console page; ``body`` is markup the caller escaped."""
    links = "".join(
        f'<a href="{href}"{" class=here" if href == here else ""}>{name}</a>' for href, name in NAV
    )
    js = '<script src="/admin/static/console.js" defer></script>' if script else ""
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{escape(title)} · pgonce"
        '</title><link rel="stylesheet" href="/admin/static/console.css">'
        f'<link rel="icon" href="data:,">{js}</head><body><header><strong>pgonce</strong>{links}'
        f"</header><main><h1>{escape(title)}</h1>{body}</main></body></html>"
    )


def table(headings: list[str], rows: list[list[str]], empty: str = "none") -> str:
    """Rows of escaped cells; all headings empty: a table of facts (label, value)."""
    if not rows:
        return f"<p><em>{escape(empty)}</em></p>"
    head = "".join(f"<th>{escape(h)}</th>" for h in headings) if any(headings) else ""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table>{f'<tr>{head}</tr>' if head else ''}{body}</table>"


def when(value: datetime | None) -> str:
    return escape(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")) if value else ""


def status(value: str) -> str:
    return f'<span class="{escape(value)}">{escape(value)}</span>'


def link(path: str, params: dict[str, str], text: str) -> str:
    return f'<a href="{escape(path + "?" + urlencode(params))}">{escape(text)}</a>'


def body_text(data: bytes) -> tuple[str, str]:
    """``(label, text)`` of a body for a ``<pre>``: its UTF-8 text, or, when it is not UTF-8, the
    text with each invalid byte as ``\\xNN``. Not escaped yet."""
    try:
        return "text (UTF-8)", data.decode("utf-8")
    except UnicodeDecodeError:
        return "not valid UTF-8: invalid bytes shown as \\xNN", data.decode(
            "utf-8", "backslashreplace"
        )


def preview(data: bytes) -> bytes:
    """The first :data:`BODY_PREVIEW` bytes, never ending inside a UTF-8 character: a cut
    character would make a UTF-8 body look invalid."""
    shown = data[:BODY_PREVIEW]
    if len(shown) == len(data):
        return shown
    for back in range(1, 4):
        lead = shown[-back]
        if lead & 0xC0 != 0x80:  # the last character's first byte
            width = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            if 0xC2 <= lead <= 0xF4 and width > back:
                return shown[:-back]
            break
    return shown


def body_block(data: bytes | None, heading: str) -> str:
    """A body shown inert: the exact text (first :data:`BODY_PREVIEW` bytes), and, when the whole
    body is JSON, the same document indented."""
    if data is None:
        return f"<h2>{escape(heading)}</h2><p><em>none stored</em></p>"
    shown = preview(data)
    label, text = body_text(shown)
    more = len(data) - len(shown)
    parts = [
        f"<h2>{escape(heading)} ({len(data):,} bytes, {escape(label)})</h2>",
        f'<pre class="body">{escape(text)}</pre>',
    ]
    if more > 0:
        parts.append(f"<p class=note>{more:,} more bytes not shown</p>")
    elif data.strip()[:1] in (b"{", b"["):
        try:
            document = json.loads(data)
            pretty = json.dumps(document, indent=2, ensure_ascii=False)
        except (ValueError, RecursionError):
            # Nested deeper than the interpreter's stack (a sender controls the body): the
            # exact text above is all there is to show.
            pass
        else:
            parts.append(f'<h3>as JSON</h3><pre class="json">{escape(pretty)}</pre>')
    return "".join(parts)


def hidden(name: str, value: str) -> str:
    return f'<input type="hidden" name="{escape(name)}" value="{escape(value)}">'
