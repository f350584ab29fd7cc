"""The service's connections to PostgreSQL: how they are opened, and what stands in between.

- One pool serves the HTTP requests, the admin page and the sweeper. Its sizes and timeouts come
  from ``[database]``; a request that cannot get a connection within ``pool_wait`` is answered
  503 with Retry-After (the middleware and the webhook receiver translate the pool's timeout),
  never held for psycopg_pool's default 30 seconds.
- A lost connection is replaced by tries at most about a second apart
  (:func:`pgonce.config.pool_kwargs`, the same arguments an application's own pool takes), so
  that after a failover pgonce follows the new primary within about a second of it accepting
  writes (with a multi-host DSN and ``target_session_attrs=read-write``, libpq finds which host
  that is).
- Behind a transaction-mode pooler (``pooler``, or found at start with ``auto``), no statement is
  prepared: psycopg's ``prepare_threshold`` is None on every connection the service opens, and
  pgonce's own statements go unnamed. LISTEN needs a session of its own: ``listen_dsn`` gives the
  inbox workers and the relay a direct connection for it; without one their wake-ups fall back
  to polling, and the first log line says so.
- While the database is away, the pool's failed connects are one warning when the run of them
  starts (what failed, and what happens meanwhile), debug lines after it, and one line when a
  connect succeeds again: psycopg_pool's own lines for each try (about one a second for as long
  as the outage lasts, and one each time it gives a try up) are not written for this pool.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from pgonce.config import TRANSACTION_POOLER, pool_kwargs
from pgonce.core.frozen import refuse_changes
from pgonce.core.outage import FailureRun
from pgonce.database import POLLING_COST, shares_server_sessions
from pgonce.service.config import PoolConfig, ServiceConfig
from pgonce.store import wire

log = logging.getLogger("pgonce.service")


@refuse_changes
@dataclass(frozen=True, slots=True)
class Topology:
    """How the service talks to PostgreSQL, once the configuration and the start-up check met."""

    #: The pooler the service runs with: "none" or "pgbouncer-transaction" ("auto" resolved).
    pooler: str
    #: psycopg's connection arguments for every connection the service opens.
    connect_kwargs: dict[str, Any]
    #: Where the inbox workers and the relay LISTEN.
    listen_dsn: str
    #: True when LISTEN goes through a transaction-mode pooler, so wake-ups are polled.
    polling: bool


async def topology(config: ServiceConfig, dsn: str) -> Topology:
    """Resolve ``pooler = "auto"`` by checking the server, and log what the service runs with.

    Behind a transaction-mode pooler the process sends pgonce's statements unnamed from the
    start. A LISTEN that would go through the pooler is logged with what polling costs.
    """
    settings = config.settings
    connect_timeout = _seconds(config.pool.connect_timeout)
    pooler = settings.pooler
    if pooler == "auto":
        shared = await asyncio.to_thread(shares_server_sessions, dsn, connect_timeout)
        pooler = TRANSACTION_POOLER if shared else "none"
        if shared:
            log.warning(
                "connections to the database share server sessions (a transaction-mode pooler "
                'such as PgBouncer): running as pooler = "pgbouncer-transaction", with no '
                "prepared statements; set [database] pooler to say so and skip this check"
            )
    kwargs: dict[str, Any] = {"connect_timeout": connect_timeout}
    if pooler == TRANSACTION_POOLER:
        kwargs["prepare_threshold"] = None
        wire.sessions_shared(None)  # said above, or configured
    else:
        kwargs["prepare_threshold"] = settings.prepare_threshold
    listen_dsn = config.listen_dsn or settings.listen_dsn
    polling = pooler == TRANSACTION_POOLER and listen_dsn is None
    if polling:
        log.warning("LISTEN through a transaction-mode pooler receives nothing: %s", POLLING_COST)
    return Topology(pooler, kwargs, listen_dsn or dsn, polling)


_POOL_LOG = logging.getLogger("psycopg.pool")

#: The service's pool, as psycopg_pool names it in its log lines.
POOL_NAME = "pgonce-service"

#: psycopg_pool's lines for one failed connect of a pool, and for a reconnection it gave up.
_CONNECT_FAILED = "error connecting in %r: %s"
_GAVE_UP = "reconnection attempt in pool %r failed after %s sec"


class _Connects(logging.Filter):
    """psycopg_pool's lines about the failed connects of one pool, said once per run of them."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.pool = name
        self.run = FailureRun(
            log, "the service's pool connects to the database again after %(count)d failed tries"
        )

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and args and args[0] == self.pool):
            return True
        if record.msg == _CONNECT_FAILED and len(args) == 2:
            error = args[1]
            self.run.failed(
                error if isinstance(error, Exception) else Exception(str(error)),
                "the service's pool failed connecting to the database (%(error)s): requests "
                "that get no connection within pool_wait are answered 503 with Retry-After and "
                "/readyz is 503, while the pool tries again about every second",
                "the service's pool failed connecting again (%(count)d in a row): %(error)s",
                {},
            )
            return False
        # The pool gave a reconnection up: the next request (or the pool's minimum) starts
        # another, which the run's first line announced.
        return record.msg != _GAVE_UP

    async def connected(self, conn: AsyncConnection[Any]) -> None:
        """psycopg_pool's ``configure``: a new connection, so a run of failures ended."""
        self.run.succeeded()


class _RequestPool(AsyncConnectionPool[Any]):
    """The request path's pool: psycopg_pool's, with its failed connects logged once a run."""

    def __init__(self, dsn: str, connects: _Connects, **kwargs: Any) -> None:
        super().__init__(dsn, configure=connects.connected, **kwargs)
        self._connects = connects

    # psycopg_pool's signatures, whose timeout parameters are its own.
    async def open(self, wait: bool = False, timeout: float = 30.0) -> None:  # noqa: ASYNC109
        if self._connects not in _POOL_LOG.filters:
            _POOL_LOG.addFilter(self._connects)
        await super().open(wait, timeout)

    async def close(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        try:
            await super().close(timeout)
        finally:
            _POOL_LOG.removeFilter(self._connects)


def request_pool(
    dsn: str, pool: PoolConfig, connect_kwargs: dict[str, Any]
) -> AsyncConnectionPool[Any]:
    """The pool of the request path (not opened): sizes, the wait bound and fast reconnection."""
    return _RequestPool(
        dsn,
        _Connects(POOL_NAME),
        min_size=pool.min_size,
        max_size=pool.max_size,
        open=False,
        name=POOL_NAME,
        **pool_kwargs(connect_kwargs, wait=pool.wait, connect_timeout=pool.connect_timeout),
    )


def _seconds(value: timedelta) -> int:
    return max(2, int(value.total_seconds()))
