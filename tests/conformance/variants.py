"""A correct Idempotency-Key endpoint built differently from pgonce, for the kit to pass.

The IETF draft leaves room: the fingerprint MAY be any digest of the request (here: the raw bytes,
so a re-serialized JSON body is another request, refused with 422), the key's lifetime is a
documented policy (no response header is defined for it), and a retry that arrives while the
original runs may wait for it instead of getting a 409. Each variation is allowed; a kit that
fails any of them judges the draft wrongly.

``/{mode}/payments``: ``plain`` sends no lifetime header; ``asctime`` sends
``Idempotency-Key-Expires`` as an RFC 9110 HTTP-date in the obsolete asctime form that every
recipient must accept; ``longkeys`` keeps keys of up to 4096 characters whole (the draft sets no
limit). Two modes are faults, not variations: ``truncate`` cuts keys to 255 characters, and
``limited`` is a rate limiter that answers every request after the first with 429. Effects are
counted in memory at ``GET /count``.

``/webhooks/shop`` is a careful Standard Webhooks receiver (secret in ``VARIANTS_SECRET``) that
refuses a signature it cannot verify with 400, as the providers' own sample receivers do, where
pgonce answers 401; its effects are at ``GET /count/webhooks``. Served by uvicorn in the tests
(``python -m bench.servers FD tests.conformance.variants:create_app``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from datetime import UTC, datetime

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pgonce.errors import WebhookError
from pgonce.http.problem import CONTENT_TYPE, problem_body
from pgonce.webhooks.schemes import build_scheme

MAX_BODY = 1024 * 1024
MAX_KEY = 255


def problem(status: int, title: str) -> Response:
    return Response(problem_body(status, title), status_code=status, media_type=CONTENT_TYPE)


def sf_string(value: str) -> str | None:
    """The decoded RFC 8941 sf-string, or None when ``value`` is not one."""
    if len(value) < 2 or value[0] != '"' or value[-1] != '"':
        return None
    out: list[str] = []
    chars = iter(value[1:-1])
    for char in chars:
        if not " " <= char <= "~":
            return None
        if char == "\\":
            escaped = next(chars, "")
            if escaped not in ('"', "\\"):
                return None
            out.append(escaped)
        elif char == '"':
            return None
        else:
            out.append(char)
    return "".join(out)


def create_app() -> Starlette:
    effects = {"count": 0}
    limited = {"seen": 0}
    stored: dict[tuple[str, str], tuple[bytes, int, bytes, str, str]] = {}
    locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def count(request: Request) -> Response:
        return JSONResponse(effects)

    async def payments(request: Request) -> Response:
        if request.path_params["mode"] == "limited":
            limited["seen"] += 1
            if limited["seen"] > 1:
                return problem(429, "Too Many Requests")
        header = request.headers.get("idempotency-key")
        if header is None:
            return problem(400, "Idempotency-Key required")
        key = sf_string(header)
        mode = request.path_params["mode"]
        if mode == "truncate" and key:
            key = key[:MAX_KEY]  # the fault: two long keys become one
        if not key or len(key) > (4096 if mode == "longkeys" else MAX_KEY):
            return problem(400, "Invalid Idempotency-Key")
        body = await request.body()
        if len(body) > MAX_BODY:
            return problem(413, "Content Too Large")
        scope = request.headers.get("authorization", "")
        fingerprint = hashlib.sha256(
            b"\0".join([request.method.encode(), request.url.path.encode(),
                        request.url.query.encode(), body])
        ).digest()  # fmt: skip
        async with locks.setdefault((scope, key), asyncio.Lock()):
            # A retry that arrives while the original runs waits for it here, then replays.
            found = stored.get((scope, key))
            if found is None:
                await asyncio.sleep(0.01)  # the work
                effects["count"] += 1
                answer = json.dumps({"id": effects["count"]}).encode()
                expires = time.asctime(time.gmtime(time.time() + 86400))
                found = (fingerprint, 201, answer, f"/payments/{effects['count']}", expires)
                stored[(scope, key)] = found
            elif found[0] != fingerprint:
                return problem(422, "Idempotency-Key reused with another request")
        _, status, answer, location, expires = found
        headers = {"location": location}
        if request.path_params["mode"] == "asctime":
            headers["idempotency-key-expires"] = expires
        return Response(answer, status_code=status, media_type="application/json", headers=headers)

    scheme = build_scheme("standard-webhooks", os.environ.get("VARIANTS_SECRET", "whsec_AA=="))
    events: dict[str, bytes] = {}
    handled = {"count": 0}

    async def webhook(request: Request) -> Response:
        if request.path_params["source"] != "shop":
            return problem(404, "Unknown source")
        body = await request.body()
        if len(body) > MAX_BODY:
            return problem(413, "Content Too Large")
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            scheme.verify(headers, body, now=datetime.now(UTC))
        except WebhookError:
            return problem(400, "Bad signature")
        try:
            json.loads(body)
        except ValueError:
            return problem(400, "Not JSON")
        event = headers["webhook-id"]
        if event in events:
            if events[event] != body:
                return problem(409, "Event id reused with another body")
            return JSONResponse({"status": "duplicate"})
        events[event] = body
        handled["count"] += 1
        return JSONResponse({"status": "stored"})

    async def webhook_count(request: Request) -> Response:
        return JSONResponse(handled)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/count", count),
            Route("/count/webhooks", webhook_count),
            Route("/webhooks/{source}", webhook, methods=["POST"]),
            Route("/{mode}/payments", payments, methods=["POST"]),
        ]
    )
