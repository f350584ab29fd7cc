"""Receivers that are wrong on purpose, each in a way seen in the field, for the kit to catch.

Served by uvicorn in the tests (``python -m bench.servers FD tests.conformance.broken:create_app``).
Effects are counted in memory and exposed the way the kit's contract asks: ``GET /count/{mode}``.

Idempotency-Key endpoints:

- ``/nostore/payments`` validates keys like a careful implementation but stores nothing: every
  retry runs again (the answer differs, the effect repeats).
- ``/naive/...`` is a response cache keyed by the raw header: no validation, no fingerprint, no
  caller scope, no body limit, a check-then-insert race, and it caches 5xx answers and Set-Cookie.

Webhook endpoints (``/{mode}/webhooks/{source}``), signed per Standard Webhooks with
``BROKEN_SECRET``:

- ``reserialize`` verifies the signature on ``json.dumps(json.loads(body))`` instead of the raw
  bytes, lets a malformed body raise (a 500), and answers refusals as plain JSON;
- ``nodedupe`` verifies the raw bytes but without any timestamp tolerance or body limit, accepts
  any source name, and acts on every delivery, duplicates and conflicting bodies included.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pgonce.errors import WebhookError
from pgonce.http.problem import CONTENT_TYPE, problem_body
from pgonce.webhooks.schemes import build_scheme


def problem(status: int, title: str) -> Response:
    return Response(problem_body(status, title), status_code=status, media_type=CONTENT_TYPE)


def create_app() -> Starlette:
    effects: Counter[str] = Counter()
    cache: dict[str, tuple[int, list[tuple[str, str]], bytes]] = {}
    events: dict[str, bytes] = {}
    secret = os.environ["BROKEN_SECRET"]
    strict = build_scheme("standard-webhooks", secret)
    lax = build_scheme("standard-webhooks", secret, tolerance=timedelta(days=3650))

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def count(request: Request) -> Response:
        return JSONResponse({"count": effects[request.path_params["mode"]]})

    async def nostore(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        if key is None:
            return problem(400, "Idempotency-Key required")
        bare = key.strip('"')
        if not bare or len(bare) > 255 or not bare.isprintable() or key.count('"') % 2:
            return problem(400, "Invalid Idempotency-Key")
        await request.body()
        effects["nostore"] += 1
        payment = effects["nostore"]
        return JSONResponse(
            {"id": payment, "nonce": uuid.uuid4().hex},
            status_code=201,
            headers={"Location": f"/nostore/payments/{payment}"},
        )

    async def naive(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        if key is not None and key in cache:
            status, headers, body = cache[key]
            replay = Response(body, status_code=status)
            replay.raw_headers = [
                *((n.encode(), v.encode()) for n, v in headers),
                (b"idempotent-replayed", b"true"),
            ]
            return replay
        await request.body()
        # The work takes a tenth of a second and the cache is filled after it: a copy that
        # arrives meanwhile misses the cache and runs again (check-then-insert).
        await asyncio.sleep(0.1)
        what = request.path_params["what"]
        if what == "fail":
            response: Response = JSONResponse(
                {"error": "upstream down", "attempt": uuid.uuid4().hex}, status_code=503
            )
        else:
            effects["naive"] += 1
            response = JSONResponse({"id": effects["naive"]}, status_code=201)
            response.headers["Location"] = f"/naive/payments/{effects['naive']}"
            if what == "cookie":
                response.set_cookie("session", "secret-session-id")
        if key is not None:
            headers = [(n.decode(), v.decode()) for n, v in response.raw_headers]
            cache[key] = (response.status_code, headers, bytes(response.body))
        return response

    async def webhook(request: Request) -> Response:
        mode = request.path_params["mode"]
        body = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        if mode == "reserialize":
            if request.path_params["source"] != "shop":
                return JSONResponse({"error": "unknown source"}, status_code=404)
            canonical = json.dumps(json.loads(body)).encode()  # a malformed body raises: a 500
            try:
                strict.verify(headers, canonical, now=datetime.now(UTC))
            except WebhookError:
                return JSONResponse({"error": "bad signature"}, status_code=401)
            event = headers["webhook-id"]
            if event not in events:
                events[event] = body
                effects[mode] += 1
            return JSONResponse({"ok": True})
        try:
            lax.verify(headers, body, now=datetime.now(UTC))
        except WebhookError as error:
            return problem(error.status, error.title)
        effects[mode] += 1
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/count/{mode}", count),
            Route("/nostore/payments", nostore, methods=["POST"]),
            Route("/naive/{what}", naive, methods=["POST"]),
            Route("/{mode}/webhooks/{source}", webhook, methods=["POST"]),
        ]
    )
