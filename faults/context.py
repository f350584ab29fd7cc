"""What every scenario gets: the suite's own PostgreSQL and redis-server, a temporary folder for
configurations and logs, the run's generated secrets, and the run's size (full or quick).

Each scenario works in a database of its own on the suite's server, migrated and with the demo
handler's table, so that its accounting counts only its own effects.
"""

from __future__ import annotations

import contextlib
import random
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import psycopg

from faults.load import MixedLoad
from faults.pg import OwnPostgres, own_postgres
from faults.procs import Proc, Processes, Secrets
from faults.proxy import free_port
from pgonce.config import DEFAULT_SCHEMA
from pgonce.service.demo import SETUP
from pgonce.store.migrate import migrate
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.schemes.base import SigningScheme

T = TypeVar("T")


def generate_secrets() -> Secrets:
    """A Standard Webhooks secret (whsec_ + base64 of 24 random bytes) and an admin token."""
    import base64

    shop = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    return Secrets(shop=shop, admin="adm-" + secrets.token_urlsafe(24))


@dataclass
class Context:
    pg: OwnPostgres
    folder: Path
    quick: bool
    seed: int
    secrets: Secrets
    redis_url: str
    #: The suite's own redis-server (the broker scenario stops and starts it).
    redis: Proc
    rng: random.Random = field(init=False)
    #: Every answer body the suite received from a refusal, scanned for secrets at the end.
    bodies: list[bytes] = field(default_factory=list)
    #: Every log file a started process wrote, scanned for secrets and tracebacks at the end.
    logs: set[Path] = field(default_factory=set)
    #: Servers that several scenarios share (:meth:`shared`), stopped when the run ends.
    servers: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _shared: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def size(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    @property
    def scheme(self) -> SigningScheme:
        return build_scheme("standard-webhooks", [self.secrets.shop])

    def shared(self, name: str, start: Callable[[], contextlib.AbstractContextManager[T]]) -> T:
        """The server ``name``, started by ``start()`` for the first scenario that asks, and
        kept for the next ones until the run ends (a pg_auto_failover formation takes a minute
        or two to start)."""
        if name not in self._shared:
            self._shared[name] = self.servers.enter_context(start())
        return cast(T, self._shared[name])

    def database(self, name: str) -> str:
        """A fresh, migrated database ``name`` with the demo handler's table; its socket DSN."""
        dsn = self.pg.database(name)
        with psycopg.connect(dsn) as conn:
            migrate(conn, DEFAULT_SCHEMA)
            conn.execute(SETUP)
            conn.commit()
        return dsn

    def processes(self) -> Processes:
        return Processes(self.folder, self.secrets)

    def serve(
        self, procs: Processes, run: str, dsn: str, *, amounts: int, minimum: int | None = None
    ) -> Served:
        """The service (with the outbox on the suite's redis) and the payments app, both on
        ``dsn``, started in ``procs``, and the mixed load ``run`` for them, not started yet
        (payment amounts from ``amounts``; ``minimum``: what the load must have acknowledged)."""
        port, pay_port = free_port(), free_port()
        served = Served(
            service=procs.service(f"{run}-service", dsn, port, self.redis_url),
            payments=procs.payments(f"{run}-payments", dsn, pay_port),
            load=MixedLoad(
                self.scheme,
                service_port=port,
                payments_port=pay_port,
                outbox_dsn=dsn,
                run=run,
                amounts=amounts,
                relays=1,
                minimum=self.size(50, 3) if minimum is None else minimum,
            ),
            port=port,
            pay_port=pay_port,
        )
        self.keep_logs(procs)
        return served

    def keep_logs(self, processes: Processes) -> None:
        self.logs.update(p.log for p in processes.started)


@dataclass
class Served:
    """What :meth:`Context.serve` started: the two processes, their ports, and the load."""

    service: Proc
    payments: Proc
    load: MixedLoad
    port: int
    pay_port: int

    def untouched(self) -> bool:
        """Whether each process was started once and still runs (none was restarted)."""
        return all(p.starts == 1 and p.alive() for p in (self.service, self.payments))


@contextlib.contextmanager
def open_context(folder: Path, *, quick: bool, seed: int) -> Iterator[Context]:
    """The suite's own PostgreSQL and redis-server, for the scenarios; both stopped on exit
    (``folder`` holds configurations and logs; the caller deletes it)."""
    with own_postgres() as pg, Processes(folder, generate_secrets()) as infra:
        port = free_port()
        redis = infra.redis("redis", port)
        ctx = Context(
            pg=pg,
            folder=folder,
            quick=quick,
            seed=seed,
            secrets=infra.secrets,
            redis_url=f"redis://127.0.0.1:{port}/0",
            redis=redis,
        )
        with ctx.servers:
            yield ctx
