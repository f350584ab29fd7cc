"""``routes`` and ``two_phase`` of the ASGI middleware name the path inside the application, as
under the WSGI and Django adapters, for an application mounted under a prefix: Starlette's
``Mount`` and uvicorn's ``--root-path``, through a real uvicorn server."""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from examples.payments import app as payments
from pgonce.http import phased
from tests.http.app import middleware_options
from tests.http.conftest import ServerFactory, servers_of

HEADERS = {"Authorization": "Bearer alice-token"}
#: The prefix the application is mounted under.
PREFIX = "/api"
DEPRECATED = "includes the root_path"


def inner_app() -> FastAPI:
    options = json.loads(os.environ.get("PGONCE_TEST_HTTP_OPTIONS") or "{}")
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"], **middleware_options(options))

    @app.post("/notes")
    async def note() -> Response:
        """Writes nothing: served without a key where ``routes`` turns idempotency off."""
        return JSONResponse({"noted": True}, status_code=201)

    @app.post("/charges")
    async def charge(request: Request) -> Response:
        op = phased(request)
        charged = await op.call("charge", _charged)
        return JSONResponse({"charged": charged}, status_code=201)

    return app


async def _charged(key: str) -> str:
    return "charged"


def create_mounted_app() -> Starlette:
    """The payments app under ``Mount(PREFIX)``; its lifespan run by the outer application."""
    inner = inner_app()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with inner.router.lifespan_context(inner):
            yield

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/health", health), Mount(PREFIX, app=inner)], lifespan=lifespan)


def serve_with_root_path() -> None:
    """``python -m tests.http.test_probe_root_path FD``: the payments app under uvicorn with
    ``root_path=PREFIX`` (``--root-path``, as behind a proxy that strips the prefix)."""
    import uvicorn

    sock = socket.socket(fileno=int(sys.argv[1]))
    config = uvicorn.Config(
        inner_app, factory=True, root_path=PREFIX, log_level="warning", access_log=False
    )
    uvicorn.Server(config).run(sockets=[sock])


MOUNTED = (
    sys.executable,
    "-m",
    "bench.servers",
    "{fd}",
    "tests.http.test_probe_root_path:create_mounted_app",
)
ROOT_PATH = (sys.executable, "-m", "tests.http.test_probe_root_path", "{fd}")


@pytest.fixture(params=["mount", "root-path"])
def mounted(
    request: pytest.FixtureRequest, dsn: str, tmp_path: Path
) -> Iterator[tuple[ServerFactory, str]]:
    """A server factory and the prefix its clients put before the application's paths."""
    if request.param == "mount":
        with servers_of(dsn, tmp_path, MOUNTED) as make:
            yield make, PREFIX
    else:
        # The proxy in front stripped the prefix: clients reach the app's paths as they are.
        with servers_of(dsn, tmp_path, ROOT_PATH) as make:
            yield make, ""


def key() -> dict[str, str]:
    return {**HEADERS, "Idempotency-Key": f'"{uuid.uuid4()}"'}


def payment(url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url, json={"amount": 1, "currency": "EUR"}, headers=headers)


def test_routes_name_the_path_inside_the_application(mounted: tuple[ServerFactory, str]) -> None:
    make, prefix = mounted
    server = make(routes={"/notes": []})
    # /notes needs no key: a POST without one passes.
    assert httpx.post(f"{server.url}{prefix}/notes", headers=HEADERS).status_code == 201
    # Other paths keep the default methods: a POST there without a key is refused.
    assert payment(f"{server.url}{prefix}/payments", HEADERS).status_code == 400
    assert payment(f"{server.url}{prefix}/payments", key()).status_code == 201
    assert DEPRECATED not in server.log.read_text()


def test_two_phase_names_the_path_inside_the_application(
    mounted: tuple[ServerFactory, str], db: psycopg.Connection[Any]
) -> None:
    make, prefix = mounted
    server = make(two_phase=["/charges"])
    headers = key()
    first = httpx.post(f"{server.url}{prefix}/charges", headers=headers)
    assert first.status_code == 201, first.text
    assert first.json() == {"charged": "charged"}
    again = httpx.post(f"{server.url}{prefix}/charges", headers=headers)
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    # One transaction on the other paths, as before.
    assert payment(f"{server.url}{prefix}/payments", key()).status_code == 201
    assert DEPRECATED not in server.log.read_text()


def test_full_paths_still_match_and_are_reported_once(
    mounted: tuple[ServerFactory, str],
) -> None:
    make, prefix = mounted
    server = make(routes={f"{PREFIX}/notes": []}, two_phase=[f"{PREFIX}/charges"])
    url = f"{server.url}{prefix}/notes"
    # The route written as the full path still turns /notes off.
    assert httpx.post(url, headers=HEADERS).status_code == 201
    assert httpx.post(url, headers=HEADERS).status_code == 201
    charged = httpx.post(f"{server.url}{prefix}/charges", headers=key())
    assert charged.status_code == 201, charged.text
    assert server.log.read_text().count(DEPRECATED) == 1


if __name__ == "__main__":
    serve_with_root_path()
