"""The processes the suite starts, and only those: the pgonce service, its worker and relay
processes, the example payments app on uvicorn, and a redis-server of its own.

Every process is started here, remembered, killed with SIGKILL or stopped with SIGTERM by its own
pid, and stopped at the end whatever happened. Their output goes to log files in the suite's
temporary folder, which the security checks scan for secrets and tracebacks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

#: The suite's own credentials, generated for the run and passed through the environment only.
SHOP_SECRET_ENV = "FAULTS_SHOP_SECRET"
ADMIN_TOKEN_ENV = "FAULTS_ADMIN_TOKEN"
REDIS_URL_ENV = "FAULTS_REDIS_URL"

SERVICE_CONFIG = """
[server]
log_format = "json"
[inbox]
workers = 2
[admin]
token = "env:FAULTS_ADMIN_TOKEN"
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:FAULTS_SHOP_SECRET"]
tolerance = "5m"
handler = "pgonce.service.demo:record_order"
"""
OUTBOX_CONFIG = """
[outbox]
publisher = "redis"
url = "env:FAULTS_REDIS_URL"
"""

#: How long a process may take to answer after a start; imports on a busy 2-core machine.
START_TIMEOUT = 60.0


class ProcessFailed(RuntimeError):
    """A process the suite started did not come up."""


@dataclass
class Proc:
    """One role (service, worker, relay, payments, redis): restartable, always the same command."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    #: A URL that answers 200 once the process is ready; None: ready as soon as started.
    ready_url: str | None = None
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    pids: list[int] = field(default_factory=list)

    def start(self, wait: bool = True) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        self.starts += 1
        self.pids.append(self.process.pid)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        if self.ready_url is None:
            return
        assert self.process is not None
        deadline = time.monotonic() + timeout
        # One client for every poll: each new one loads the CA bundle (half a second of CPU on
        # a busy machine), for a plain-HTTP URL at that.
        with httpx.Client(timeout=2, verify=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ProcessFailed(f"{self.name} exited with {self.process.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.ready_url).status_code == 200:
                        return
                time.sleep(0.05)
        raise ProcessFailed(f"{self.name} did not answer {self.ready_url} in {timeout:.0f} s")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, by this process's own pid."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            self.kills += 1

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not end in ``timeout``."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None


def pgonce(*args: str) -> list[str]:
    return [sys.executable, "-m", "pgonce", *args]


@dataclass
class Secrets:
    shop: str
    admin: str

    def env(self) -> dict[str, str]:
        return {SHOP_SECRET_ENV: self.shop, ADMIN_TOKEN_ENV: self.admin}

    def all(self) -> list[str]:
        """The strings that must never appear in a log or an answer."""
        return [self.shop, self.shop.removeprefix("whsec_"), self.admin]


class Processes:
    """Builds the roles on one database and stops every one of them on exit."""

    def __init__(self, folder: Path, secrets: Secrets) -> None:
        self.folder = folder
        self.secrets = secrets
        self.started: list[Proc] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop(timeout=30)
        self.started.clear()

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, **self.secrets.env(), **(extra or {})}
        # The service must not fall back to an embedded server of its own.
        env.pop("PGONCE_DATA_DIR", None)
        return env

    def config(self, name: str, redis_url: str | None, extra: str = "") -> Path:
        path = self.folder / f"{name}.toml"
        path.write_text(SERVICE_CONFIG + (OUTBOX_CONFIG if redis_url else "") + extra)
        return path

    def _add(self, proc: Proc, wait: bool = True) -> Proc:
        self.started.append(proc)
        proc.start(wait=wait)
        return proc

    def service(
        self, name: str, dsn: str, port: int, redis_url: str | None = None, *, extra: str = ""
    ) -> Proc:
        """``pgonce serve``; ``extra``: more of its TOML configuration (whole sections)."""
        config = self.config(name, redis_url, extra)
        argv = pgonce("serve", "--config", str(config), "--dsn", dsn, "--port", str(port))
        env = self._env({REDIS_URL_ENV: redis_url} if redis_url else None)
        url = f"http://127.0.0.1:{port}/healthz"
        return self._add(Proc(name, argv, env, self.folder / f"{name}.log", ready_url=url))

    def part(self, name: str, command: str, dsn: str, redis_url: str | None = None) -> Proc:
        """``pgonce worker`` or ``pgonce relay`` on the same configuration."""
        config = self.config(name, redis_url)
        argv = pgonce(command, "--config", str(config), "--dsn", dsn)
        env = self._env({REDIS_URL_ENV: redis_url} if redis_url else None)
        return self._add(Proc(name, argv, env, self.folder / f"{name}.log"))

    def payments(self, name: str, dsn: str, port: int) -> Proc:
        """The example payments app (Idempotency-Key middleware) in uvicorn."""
        argv = [
            sys.executable, "-m", "uvicorn", "--factory", "examples.payments.app:create_app",
            "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
        ]  # fmt: skip
        env = self._env({"PGONCE_DSN": dsn})
        url = f"http://127.0.0.1:{port}/health"
        return self._add(Proc(name, argv, env, self.folder / f"{name}.log", ready_url=url))

    def redis(self, name: str, port: int) -> Proc:
        """A redis-server of the suite's own: durable (AOF, fsync always) so that a stop and start
        keeps what it acknowledged, and loopback only."""
        data = self.folder / name
        data.mkdir(exist_ok=True)
        argv = [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data),
            "--protected-mode", "yes",
        ]  # fmt: skip
        proc = Proc(name, argv, self._env(), self.folder / f"{name}.log")
        self._add(proc)
        wait_redis(port)
        return proc


def wait_redis(port: int, timeout: float = 30) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    return
            time.sleep(0.05)
    finally:
        client.close()
    raise ProcessFailed(f"redis-server on port {port} did not answer")
