"""A real uvicorn server per test, in its own process, on a loopback socket the test bound itself.

The test binds port 0 on 127.0.0.1 and hands the listening socket to the uvicorn process
(``python -m bench.servers``, which also says why not ``uvicorn --fd``): no race for a free port,
and the server process can be killed with SIGKILL like any production crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL: no cleanup, no rollback from Python; PostgreSQL sees the connection die.

        The whole process group: a server with worker processes (gunicorn) dies at once too.
        """
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


#: The server of the FastAPI test app; ``{fd}`` is the listening socket's descriptor.
FASTAPI = (sys.executable, "-m", "bench.servers", "{fd}", "tests.http.app:create_app")


def start_server(
    dsn: str, log: Path, options: dict[str, Any], argv: Sequence[str] = FASTAPI
) -> Server:
    """Start ``argv`` (the FastAPI test app by default) on a socket bound here; wait for /health."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    env = {
        **os.environ,
        "PGONCE_TEST_HTTP_DSN": dsn,
        "PGONCE_TEST_HTTP_OPTIONS": json.dumps(options),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            [part.format(fd=sock.fileno()) for part in argv],
            cwd=ROOT,
            env=env,
            pass_fds=[sock.fileno()],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, for kill()
        )
    sock.close()
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {log.read_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    server.stop()
    raise AssertionError(f"the server never became ready: {log.read_text()}")


ServerFactory = Callable[..., Server]


@pytest.fixture
def make_server(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    """Start the test app on ``dsn`` with middleware options; every server stops at teardown."""
    with servers_of(dsn, tmp_path, FASTAPI) as make:
        yield make


@contextlib.contextmanager
def servers_of(dsn: str, folder: Path, argv: Sequence[str]) -> Iterator[ServerFactory]:
    """A factory of servers running ``argv`` on ``dsn``, each stopped on exit."""
    servers: list[Server] = []

    def make(**options: Any) -> Server:
        server = start_server(dsn, folder / f"server-{len(servers)}.log", options, argv)
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def server(make_server: ServerFactory) -> Server:
    """The test app with the middleware's defaults."""
    return make_server()


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for the test's own reads of the database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn
