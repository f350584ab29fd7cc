"""Running the service: the HTTP app on uvicorn plus the background loops, and a clean stop.

``pgonce serve`` runs every part in one process; ``pgonce worker``, ``pgonce relay`` and the
sweeper run one part alone, so that a deployment scales each separately (several processes of each
may run against one database: the inbox workers and relays share rows with ``FOR UPDATE SKIP
LOCKED``, the sweepers skip each other's locked rows, the completers each other's leases).

SIGHUP changes nothing (the configuration is read once, at start): it is logged, and the service
keeps running. Stopping (SIGTERM or SIGINT): uvicorn stops accepting and finishes the requests it
has; the workers finish or roll back their in-flight handlers; the relays mark what the broker
acknowledged and cancel a statement stalled on the database; then the process exits 0. Each waits
at most ``[server] stop_timeout`` (30 s); a second signal cuts the requests still in flight at once
(a delivery is answered 503). Nothing acknowledged is
lost: a delivery is answered only after its commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pgonce.errors import ConfigError, ServiceFailed
from pgonce.extras import needs
from pgonce.publishers.base import Publisher
from pgonce.relay import Relay
from pgonce.service.admin import Admin
from pgonce.service.app import ServiceApp
from pgonce.service.config import ServiceConfig
from pgonce.service.metrics import ServiceMetrics
from pgonce.service.pools import request_pool, topology
from pgonce.store._async.health import AsyncHealthCheck
from pgonce.store._async.phases import AsyncPhaseStore, complete_every
from pgonce.store._async.sweeper import AsyncSweeper, sweep_every
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.worker import InboxWorker

with needs("server", "the pgonce service"):
    import uvicorn
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger("pgonce.service")

PARTS = ("http", "workers", "relay", "sweeper", "completer")


@dataclass(frozen=True)
class Running:
    """What a started service exposes to the code that started it (tests, the demo)."""

    url: str
    app: ServiceApp
    stop: asyncio.Event


def build_publisher(config: ServiceConfig) -> Publisher:
    outbox = config.outbox
    if outbox is None:
        raise ConfigError("no [outbox] publisher is configured")
    if outbox.publisher == "rabbitmq":
        from pgonce.publishers.rabbitmq import RabbitMQPublisher

        return RabbitMQPublisher(
            outbox.url,
            exchange=outbox.exchange,
            declare=outbox.declare,
            max_message_size=outbox.max_message_size,
        )
    if outbox.publisher == "nats":
        from pgonce.publishers.nats import NatsPublisher

        return NatsPublisher(outbox.url, msg_id_prefix=outbox.msg_id_prefix)
    if outbox.publisher == "redis":
        from pgonce.publishers.redis_streams import RedisStreamsPublisher

        return RedisStreamsPublisher(outbox.url)
    from pgonce.publishers.http import HttpPublisher

    assert outbox.secret is not None
    return HttpPublisher(secret=outbox.secret, url=outbox.url)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a port in use is one clear line, not a stack."""
    try:
        listening = _bound(host, port)
        try:
            listening.listen(2048)
        except OSError:
            listening.close()
            raise
    except OSError as error:
        raise ConfigError(
            f"cannot listen on {host}:{port}: {listen_problem(host, error)}"
        ) from None
    listening.set_inheritable(True)
    return listening


def _bound(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    listening = socket.socket(family, kind, proto)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
    except OSError:
        listening.close()
        raise
    return listening


def listen_problem(host: str, error: OSError) -> str:
    """What ``error``, raised binding or listening on ``host``, says is wrong, with the setting
    to change: the address (not one, or not this host's), the port (in use, or privileged)."""
    reason = error.strerror or str(error)
    if isinstance(error, socket.gaierror):
        return (
            f"{host!r} is neither an IP address nor a host name this host resolves ({reason}), "
            "so it cannot be bound; choose one of this host's addresses (0.0.0.0 for all of "
            "them) with --host or [server] host"
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return (
            f"{host} is not an address of this host ({reason}); choose one of its addresses "
            "(0.0.0.0 for all of them) with --host or [server] host"
        )
    if error.errno == errno.EADDRINUSE:
        return f"{reason}: another process holds the port; choose one with --port or [server] port"
    if error.errno == errno.EACCES:
        return (
            f"{reason}: a port below 1024 needs privileges; choose one with --port or [server] port"
        )
    return reason


def host_problem(host: str) -> str | None:
    """Why the service could not listen on ``host``, or None when it can: checked on a port the
    system picks, so that an address that cannot be bound is said before the start does anything."""
    try:
        _bound(host, 0).close()
    except OSError as error:
        return listen_problem(host, error)
    return None


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM and SIGINT belong to the service, which
    sets ``stop`` so that the loops end together with the HTTP server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run(
    config: ServiceConfig,
    dsn: str,
    *,
    parts: Iterable[str] = PARTS,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[Running], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Run the chosen ``parts`` until ``stop`` is set or SIGTERM/SIGINT arrives."""
    chosen = set(parts)
    stop = stop or asyncio.Event()
    #: Set by a second SIGTERM or SIGINT: the stop no longer waits for the requests in flight.
    hurry = asyncio.Event()

    def stop_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop_signal)
    # SIGHUP's default ends the process at once: a reload asked the way other servers take it
    # cut the in-flight requests and left the embedded server running, with no line said.
    with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
        loop.add_signal_handler(signal.SIGHUP, _hangup)
    schema = config.settings.schema
    found = await topology(config, dsn)
    connect = found.connect_kwargs
    sources = [s.source for s in config.sources]
    policies = config.retention_policies()
    relays = (
        [
            Relay(
                dsn,
                build_publisher(config),
                schema=schema,
                listen_dsn=found.listen_dsn,
                prepare_threshold=connect["prepare_threshold"],
            )
            for _ in range(config.outbox.relays)
        ]
        if config.outbox and "relay" in chosen
        else []
    )
    metrics = ServiceMetrics(relay_stats=lambda: [r.stats for r in relays])
    health = AsyncHealthCheck(policies, schema=schema)
    tasks: list[asyncio.Task[Any]] = []
    # Bound before anything starts: a port in use ends the start with one clear line.
    listening = _listen(config.host, config.port) if "http" in chosen else None
    async with request_pool(dsn, config.pool, connect) as pool:
        if "workers" in chosen and any(s.handles for s in sources):
            worker = InboxWorker(
                sources,
                dsn=dsn,
                schema=schema,
                concurrency=config.workers,
                listen_dsn=found.listen_dsn,
                connect_kwargs=connect,
                on_batch=metrics.record_batch,
                on_failure=metrics.record_handler_failure,
                on_connection_failure=metrics.record_worker_failure,
                shutdown_timeout=config.stop_timeout,
            )
            tasks.append(asyncio.create_task(worker.run(stop), name="inbox-workers"))
        for relay in relays:
            # A batch at the broker gets its grace to be marked, within the stop's bound.
            relay.stop_grace = min(relay.stop_grace, config.stop_timeout)
            tasks.append(asyncio.create_task(relay.run(stop), name="outbox-relay"))
        if "sweeper" in chosen:
            sweeper = AsyncSweeper(policies, schema=schema)
            tasks.append(
                asyncio.create_task(
                    sweep_every(
                        pool,
                        sweeper,
                        stop,
                        every=config.sweep_every,
                        on_run=metrics.record_sweep,
                        on_failure=metrics.record_sweep_failure,
                    ),
                    name="sweeper",
                )
            )
        completer = config.completer
        if completer is not None and "completer" in chosen:
            tasks.append(
                asyncio.create_task(
                    complete_every(
                        pool,
                        AsyncPhaseStore(schema=schema, lease=completer.lease),
                        completer.operations,
                        stop,
                        every=completer.every,
                        max_age=completer.max_age,
                        retire_after=completer.retire_after,
                        on_run=metrics.record_completer,
                        on_failure=metrics.record_completer_failure,
                    ),
                    name="completer",
                )
            )
        failed = _watch(tasks, stop)
        try:
            if listening is not None:
                await _serve_http(
                    config, listening, pool, sources, metrics, health, stop, hurry, tasks, on_ready
                )
            else:
                log.info("running %s", ", ".join(sorted(chosen)))
                await stop.wait()
        finally:
            # Whatever ended the run, the loops stop together and are waited for.
            stop.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for task, result in zip(tasks, results, strict=True):
                if (
                    isinstance(result, BaseException)
                    and not isinstance(result, asyncio.CancelledError)
                    and task not in failed
                ):
                    log.error("%s ended with an error: %s", task.get_name(), result)
        if failed:
            task = failed[0]
            error = task.exception()
            raise ServiceFailed(f"the {task.get_name()} stopped the service: {_reason(error)}")


def _cut_requests(server: uvicorn.Server) -> None:
    if server.server_state.tasks:
        log.warning(
            "a second stop signal: cutting %d request(s) still in flight",
            len(server.server_state.tasks),
        )
    server.force_exit = True
    for task in list(server.server_state.tasks):
        task.cancel(msg="a second stop signal")


def _hangup() -> None:
    log.warning(
        "SIGHUP: pgonce does not reload its configuration; it keeps running with the one it "
        "started with (stop it with SIGTERM and start it again to apply a change)"
    )


def _reason(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else "no reason given"


def _watch(tasks: list[asyncio.Task[Any]], stop: asyncio.Event) -> list[asyncio.Task[Any]]:
    """Stop the service as soon as one of ``tasks`` ends with an error, logging it at once.

    Returns the list the failed tasks are added to. A part that died would otherwise leave the
    service answering /readyz while it no longer sweeps, relays or handles events.
    """
    failed: list[asyncio.Task[Any]] = []

    def ended(task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        failed.append(task)
        log.error(
            "%s ended with an error, stopping the service: %s",
            task.get_name(),
            _reason(task.exception()),
        )
        stop.set()

    for task in tasks:
        task.add_done_callback(ended)
    return failed


async def _serve_http(
    config: ServiceConfig,
    listening: socket.socket,
    pool: AsyncConnectionPool[Any],
    sources: list[Any],
    metrics: ServiceMetrics,
    health: AsyncHealthCheck,
    stop: asyncio.Event,
    hurry: asyncio.Event,
    tasks: list[asyncio.Task[Any]],
    on_ready: Callable[[Running], Coroutine[Any, Any, None]] | None,
) -> None:
    schema = config.settings.schema
    receiver = InboxReceiver(sources, pool=pool, schema=schema) if sources else None
    admin = Admin(
        config.admin_token,
        pool,
        schema=schema,
        health=health,
        stuck_after=lambda: health.stuck_after,
        sources=[source.name for source in sources],
        answered=metrics.answered,
    )
    app = ServiceApp(
        pool=pool, schema=schema, receiver=receiver, metrics=metrics, health=health, admin=admin
    )
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(config.stop_timeout.total_seconds()),
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[listening]), name="http")
    while not server.started:
        if serving.done():
            await serving  # raises what made startup fail
            raise ConfigError(f"the HTTP server on {config.host}:{config.port} did not start")
        await asyncio.sleep(0.01)
    port = listening.getsockname()[1]
    # An IPv6 address goes in brackets: "http://::1:8000" is no URL a client can open.
    host = f"[{config.host}]" if ":" in config.host else config.host
    url = f"http://{host}:{port}"
    log.info("serving on %s", url)
    try:
        print(f"pgonce: serving on {url}", flush=True)
    except BrokenPipeError:
        # stdout's reader went away (`pgonce serve | head -1`): the line is a courtesy, and the
        # service must not stop for it, as it did, in silence. stdout goes nowhere from now on.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if on_ready is not None:
        tasks.append(asyncio.create_task(on_ready(Running(url, app, stop)), name="on-ready"))
    waiting = asyncio.create_task(stop.wait())
    await asyncio.wait([serving, waiting], return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    # uvicorn's stop says "CTRL+C to force quit" while it waits for the requests in flight; its
    # own signal handling is off, so a second signal is passed on here: the requests are cut as
    # at the end of the stop's bound (a delivery is answered 503, its transaction rolled back).
    hurrying = asyncio.create_task(hurry.wait())
    hurrying.add_done_callback(lambda done: None if done.cancelled() else _cut_requests(server))
    await serving
    hurrying.cancel()
    waiting.cancel()
    if receiver is not None:
        await receiver.close()
