"""RFC 9457 problem details: the one shape of every error pgonce answers over HTTP.

Bodies carry a status, a short public title and an optional detail written for the client. They
never echo a secret, a signature, another caller's data or a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from http import HTTPStatus
from typing import Any

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

CONTENT_TYPE = "application/problem+json"


def problem_body(
    status: int, title: str | None = None, detail: str | None = None, **extra: Any
) -> bytes:
    """The JSON body of a problem; ``title`` defaults to the status phrase."""
    document: dict[str, Any] = {
        "type": "about:blank",
        "title": title or HTTPStatus(status).phrase,
        "status": status,
    }
    if detail:
        document["detail"] = detail
    document.update(extra)
    return json.dumps(document, separators=(",", ":")).encode()


async def send_problem(
    send: Send,
    status: int,
    title: str | None = None,
    detail: str | None = None,
    *,
    headers: Iterable[tuple[str, str]] = (),
    **extra: Any,
) -> None:
    """Answer an ASGI HTTP request with a problem response."""
    body = problem_body(status, title, detail, **extra)
    raw_headers = [
        (b"content-type", CONTENT_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
        *((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
