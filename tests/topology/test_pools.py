"""Pools that fail fast and come back fast, and the ``[database]`` settings that shape them.

- every new setting is read from the file and the environment, secrets by reference only, and
  every problem is listed at once;
- a request that cannot get a connection within ``pool_wait`` is answered 503 with Retry-After
  (problem+json) by the webhook receiver and by the idempotency middleware, not after the pool's
  30 seconds;
- after an outage the pool's next connection comes with the first request once the server
  accepts connections again, not at the end of a doubling backoff.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pgonce.config import Settings, pool_kwargs
from pgonce.errors import ConfigError
from pgonce.http import IdempotencyMiddleware
from pgonce.http.middleware import header_scope
from pgonce.service import runner
from pgonce.service.config import PoolConfig, load
from pgonce.service.pools import request_pool
from pgonce.webhooks.schemes import build_scheme
from tests.service.test_config import SECRET, write
from tests.stalling import proxy_to

LISTEN_URL = "postgresql://listener:s3cret@10.0.0.5:5432/app"


def test_the_database_settings_from_file_and_environment(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[database]
pooler = "pgbouncer-transaction"
listen_dsn = "env:LISTEN_URL"
pool_min_size = 1
pool_max_size = 4
connect_timeout = "3s"
pool_wait = "250ms"
""",
    )
    config = load(path, {"LISTEN_URL": LISTEN_URL, "PGONCE__DATABASE__POOL_MAX_SIZE": "6"})
    assert config.settings.pooler == "pgbouncer-transaction"
    assert config.settings.connect_kwargs() == {"prepare_threshold": None}
    assert config.listen_dsn == LISTEN_URL
    assert config.pool == PoolConfig(1, 6, timedelta(seconds=3), timedelta(milliseconds=250))
    assert "s3cret" not in repr(config)


def test_defaults_and_the_environment_alone() -> None:
    config = load(None, {"PGONCE_POOLER": "none", "PGONCE_LISTEN_DSN": LISTEN_URL})
    assert config.pool == PoolConfig()
    assert config.pool.wait == timedelta(seconds=1)
    assert config.settings.pooler == "none"
    assert config.settings.listen_dsn == LISTEN_URL
    assert config.listen_dsn is None  # the file's setting, which would win over the environment


def test_every_bad_database_setting_is_listed(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
[database]
pooler = "pgbouncer"
listen_dsn = "{LISTEN_URL}"
pool_min_size = 5
pool_max_size = 2
connect_timeout = "1s"
pool_wait = "0s"
""",
    )
    with pytest.raises(ConfigError) as raised:
        load(path, {})
    message = str(raised.value)
    assert "has 5 problems" in message
    assert "database.pooler: is one of auto, none, pgbouncer-transaction" in message
    assert 'database.listen_dsn: secrets are given by reference: write "env:NAME"' in message
    assert "database.pool_max_size: 2 is less than pool_min_size (5)" in message
    assert "database.connect_timeout: must be whole seconds, at least 2s" in message
    assert "database.pool_wait: must be longer than 0s" in message
    assert "s3cret" not in message
    missing = write(tmp_path, '[database]\nlisten_dsn = "env:NOT_SET_ANYWHERE"\n')
    with pytest.raises(ConfigError, match="the environment variable NOT_SET_ANYWHERE is not set"):
        load(missing, {})


SERVICE = """
[database]
pool_min_size = 1
pool_max_size = 1
pool_wait = "200ms"
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:SHOP_SECRET"]
"""


async def run_service(
    dsn: str, tmp_path: Path, test: Callable[[runner.Running], Awaitable[None]]
) -> None:
    """Run the service's HTTP part in this process while ``test`` talks to it."""
    config = load(write(tmp_path, SERVICE), {"SHOP_SECRET": SECRET})
    config = type(config)(**{**config.__dict__, "port": 0})
    failure: list[BaseException] = []

    async def on_ready(running: runner.Running) -> None:
        try:
            await test(running)
        except BaseException as error:
            failure.append(error)
        finally:
            running.stop.set()

    await runner.run(config, dsn, parts=("http",), on_ready=on_ready)
    if failure:
        raise failure[0]


def _is_problem_503(answer: httpx.Response) -> None:
    assert answer.status_code == 503
    assert int(answer.headers["retry-after"]) >= 1
    assert answer.headers["content-type"].startswith("application/problem+json")


async def test_a_delivery_that_gets_no_connection_is_answered_503_at_once(
    dsn: str, tmp_path: Path
) -> None:
    scheme = build_scheme("standard-webhooks", SECRET)
    body = b'{"type": "order.created"}'
    headers = {**scheme.sign(body, event_id="evt_1"), "content-type": "application/json"}

    async def test(running: runner.Running) -> None:
        pool = running.app.pool
        assert pool.timeout == 0.2  # pool_wait, not psycopg_pool's 30 s
        held = await pool.getconn()  # the pool's only connection
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
            try:
                started = time.monotonic()
                answer = await client.post("/webhooks/shop", content=body, headers=headers)
                waited = time.monotonic() - started
            finally:
                await pool.putconn(held)
            _is_problem_503(answer)
            assert waited < 10  # far from the 30 s a request used to hang
            again = await client.post("/webhooks/shop", content=body, headers=headers)
            assert again.status_code == 200

    await run_service(dsn, tmp_path, test)


async def test_the_middleware_answers_503_when_the_pool_has_no_connection(dsn: str) -> None:
    async def endpoint(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True}, status_code=201)

    async with AsyncConnectionPool(dsn, min_size=1, max_size=1, timeout=0.2, open=False) as pool:
        await pool.wait()
        app = IdempotencyMiddleware(
            Starlette(routes=[Route("/pay", endpoint, methods=["POST"])]),
            pool=pool,
            key_scope=header_scope("authorization"),
        )
        transport = httpx.ASGITransport(app=app)
        headers = {"authorization": "Bearer a", "idempotency-key": "k1"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            held = await pool.getconn()
            try:
                answer = await client.post("/pay", json={"n": 1}, headers=headers)
            finally:
                await pool.putconn(held)
            _is_problem_503(answer)
            assert (await client.post("/pay", json={"n": 1}, headers=headers)).status_code == 201


async def _select_one(pool: AsyncConnectionPool[Any], wait: float | None = None) -> None:
    async with pool.connection(timeout=wait) as conn:
        await conn.execute("SELECT 1")


def _service_pool(dsn: str, wait: timedelta) -> AsyncConnectionPool[Any]:
    settings = PoolConfig(min_size=2, max_size=4, wait=wait)
    return request_pool(dsn, settings, {"connect_timeout": 2})


def _application_pool(dsn: str, wait: timedelta) -> AsyncConnectionPool[Any]:
    # What the how-to and the example apps do with their own pool.
    arguments = Settings().pool_kwargs(wait=wait)
    return AsyncConnectionPool(dsn, min_size=2, max_size=4, open=False, **arguments)


@pytest.mark.parametrize("make_pool", [_service_pool, _application_pool], ids=["service", "app"])
async def test_after_an_outage_the_first_request_gets_a_new_connection(
    dsn: str, make_pool: Callable[[str, timedelta], AsyncConnectionPool[Any]]
) -> None:
    with proxy_to(dsn) as proxy:
        proxied = make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port))
        async with make_pool(proxied, timedelta(milliseconds=300)) as pool:
            await pool.wait()
            proxy.refuse(True)  # the server is gone: open connections cut, new ones reset
            # Each request fails at once with an error the service answers 503, never a hang.
            for _ in range(3):
                with pytest.raises((PoolTimeout, psycopg.OperationalError)):
                    await _select_one(pool)
            # Long enough for psycopg_pool's default backoff (1, 2, 4 s...) to be waiting 4 s.
            await asyncio.sleep(3.5)
            proxy.refuse(False)
            # The server is back: the first request, within one pool wait of a second, gets a
            # connection. With the default backoff the next try would still be seconds away.
            await _select_one(pool, wait=1.5)


def test_pool_kwargs_refuse_what_libpq_or_the_pool_cannot_honour() -> None:
    assert pool_kwargs({"prepare_threshold": None})["kwargs"] == {
        "prepare_threshold": None,
        "connect_timeout": 2,
    }
    with pytest.raises(ConfigError, match="wait must be longer than 0s"):
        pool_kwargs(wait=timedelta(0))
    with pytest.raises(ConfigError, match="whole seconds"):
        pool_kwargs(connect_timeout=timedelta(milliseconds=2500))
    with pytest.raises(ConfigError, match="at least 2s"):
        pool_kwargs(connect_timeout=timedelta(seconds=1))
