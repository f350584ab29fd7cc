"""Run the service: webhook inbox, inbox workers, outbox relay, sweeper, health, metrics, admin.

One process runs every part; `pgonce worker` and `pgonce relay` run one part alone, so that a
deployment scales each separately. The configuration is a TOML file (--config or $PGONCE_CONFIG);
every value can be overridden from the environment as PGONCE__SECTION__KEY, and secrets are given
as "env:NAME". Invalid configuration is refused with every problem listed. A small one:

  [database]
  dsn = "env:DATABASE_URL"
  require_dsn = true                         # never fall back to the embedded PostgreSQL

  [sources.shop]                             # POST /webhooks/shop
  scheme = "standard-webhooks"
  secrets = ["env:SHOP_WEBHOOK_SECRET"]
  handler = "myapp.webhooks:on_shop_event"   # async def on_shop_event(event, conn)

  [outbox]                                   # the relay publishes the outbox here
  publisher = "rabbitmq"                     # or nats, redis, http
  url = "env:BROKER_URL"

pgonce serve applies pending migrations at start (as `pgonce migrate` does), so that one process is
enough to try it; `pgonce worker` and `pgonce relay` never do: they refuse a schema that is not
migrated.

HTTP: POST /webhooks/{source}, GET /healthz (alive), GET /readyz (database reachable and migrated),
GET /metrics (Prometheus), /admin (only when [admin] token is configured).

SIGTERM or SIGINT stops accepting, lets in-flight work finish or roll back, and exits 0.
With --demo the service fires a signed retry storm at itself once it is up and prints the proof.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import psycopg

from pgonce.cli.common import (
    add_database_options,
    announced_database,
    bounded_int,
    command_connection,
    database_options,
    print_proof,
    require_migrated,
    say,
    stop_on_sigterm,
)
from pgonce.core.retention import format_duration
from pgonce.core.urls import public
from pgonce.errors import ConfigError, UsageError
from pgonce.extras import needs
from pgonce.store.errors import translate_errors
from pgonce.store.migrate import migrate
from pgonce.webhooks.schemes.base import SigningScheme

if TYPE_CHECKING:
    from pgonce.database import Database
    from pgonce.service.config import ServiceConfig
    from pgonce.service.runner import Running

# The service's modules are imported by the functions that run it, so that `pgonce --help` and the
# core commands work without the `server` extra; running without it raises MissingExtra.

NAME = "serve"
HELP = "run the service: webhook inbox, workers, relay, sweeper, metrics, admin"


def add_service_options(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)


def port_arg(text: str) -> int:
    """An argparse type for a TCP port, 0 to 65535 as in [server] port."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give 0 to 65535")
    return port


def configure(parser: argparse.ArgumentParser) -> None:
    add_service_options(parser)
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=port_arg, help="port to listen on (default 8000; 0 picks one)"
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="once up, fire a signed retry storm at the first source with a handler and print "
        "the exactly-once proof",
    )
    parser.add_argument(
        "--demo-orders", type=bounded_int(1), default=100, help="orders in the storm (default 100)"
    )
    parser.add_argument(
        "--demo-copies",
        type=bounded_int(1),
        default=5,
        help="deliveries of each order (default 5)",
    )


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """The configuration file and environment, with the command line's options on top."""
    from pgonce.service.config import load

    config = load(args.config)
    settings = replace(config.settings, **database_options(args))
    top = {
        k: v
        for k, v in (("host", getattr(args, "host", None)), ("port", getattr(args, "port", None)))
        if v is not None
    }
    return replace(config, settings=settings, **top)


def run_parts(args: argparse.Namespace, parts: Iterable[str]) -> int:
    from pgonce.service import logs, runner
    from pgonce.service.runner import PARTS

    keep_running_on_sighup()
    parts = tuple(parts)
    #: Set once the service has run (its loop returned): a stop signal after that comes while
    #: what the start opened closes (the embedded PostgreSQL stops), not before it was up.
    served: Database | None = None
    try:
        # Loading imports the sources' handlers, which for a large application takes seconds.
        config = service_config(args)
        refuse_idle(config, parts)
        if "http" in parts:
            refuse_unbindable(args, config)
        logs.configure(config.log_format, level=logging.DEBUG if args.verbose else logging.INFO)
        with announced_database(config.settings, then=f"configuration from {config.origin}") as db:
            if set(parts) != set(PARTS):
                # worker and relay run beside a service that owns the schema: never create one.
                require_migrated(db.dsn, config.settings.schema)
            else:
                # [database] connect_timeout, as every connection of the service: psycopg's own
                # default kept a start on a stalled network waiting for over two minutes.
                connect_timeout = int(config.pool.connect_timeout.total_seconds())
                applied = migrate_at_start(db.dsn, config.settings.schema, connect_timeout)
                if applied:
                    say(f"pgonce: applied migrations {', '.join(f'{v:04d}' for v in applied)}")
            on_ready = None
            if getattr(args, "demo", False):
                on_ready = _demo(config, db.dsn, args.demo_orders, args.demo_copies)
                asyncio.run(_setup_demo(db.dsn))
            try:
                asyncio.run(runner.run(config, db.dsn, parts=parts, on_ready=on_ready))
                served = db
            finally:
                # The loop's handlers are gone with it (SIGHUP's back to its default): a signal
                # while the embedded server stops must still unwind, or change nothing.
                stop_on_sigterm()
                keep_running_on_sighup()
    except KeyboardInterrupt:
        if served is not None:
            # A second stop signal while the embedded PostgreSQL stops: the service was up and
            # has stopped; the server got its shutdown request, and the wait for it was cut.
            say(
                "pgonce: stopped (a second stop signal cut the wait for the embedded PostgreSQL "
                "to finish stopping)"
                if served.embedded
                else "pgonce: stopped"
            )
            return 0
        # SIGTERM or SIGINT before the service was up (loading the configuration, starting the
        # embedded server, migrating): a stop asked for, as once it is up; what the start opened
        # is closed by now, and a migration under way rolled back (each in its own transaction).
        say("pgonce: stopped before the service was up")
        return 0
    say("pgonce: stopped")
    return 0


def keep_running_on_sighup() -> None:
    """Log SIGHUP and go on, from the start: as the running service does (the configuration is
    read once, at start), while the embedded server starts and the start migrates too.

    Its default ends the process on the spot: a reload asked the way other servers take it,
    before the service was up, killed the start and left the embedded PostgreSQL running.
    """
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, _hangup)


def _hangup(signum: int, frame: object) -> None:
    from pgonce.service.runner import _hangup as said

    said()


#: How long the start waits for the migration lock that another runner (``pgonce migrate``, a
#: replica's start) holds while it migrates, before it ends with one line naming it. The same
#: order as the waits for a table's lock that the migration itself allows (five tries of
#: DEFAULT_LOCK_TIMEOUT, with pauses, about half a minute); without it, a runner stuck in its
#: transaction kept the start waiting for good, saying nothing.
MIGRATION_LOCK_WAIT = timedelta(seconds=30)

#: After this long, a start still migrating says once what the migration waits for.
MIGRATION_NOTICE_AFTER = timedelta(seconds=1)

log = logging.getLogger("pgonce.service")


def migrate_at_start(dsn: str, schema: str, connect_timeout: int) -> list[int]:
    """Apply the pending migrations, within :data:`MIGRATION_LOCK_WAIT` for the runners' lock
    (the migration bounds its waits for a table's lock itself), saying once what it waits for
    when it takes longer than :data:`MIGRATION_NOTICE_AFTER`."""
    with (
        translate_errors("connecting"),
        command_connection(dsn, connect_timeout=connect_timeout) as conn,
    ):
        done = threading.Event()
        watcher = threading.Thread(
            target=_say_what_migration_waits_for,
            args=(dsn, conn.info.backend_pid, connect_timeout, done),
            name="pgonce-migration-watch",
            daemon=True,
        )
        watcher.start()
        try:
            return migrate(conn, schema, lock_wait=MIGRATION_LOCK_WAIT)
        finally:
            done.set()  # the watcher ends after its current look, if any


#: What a migrating backend waits for, and who holds it (the first blocker).
_WAITING = r"""
SELECT w.wait_event_type, w.wait_event,
       (SELECT CASE WHEN l.locktype = 'relation' THEN 'a lock on ' || l.relation::regclass::text
                    WHEN l.locktype = 'advisory' THEN 'the migration lock'
                    ELSE 'a lock (' || l.locktype || ')' END
          FROM pg_locks l WHERE l.pid = w.pid AND NOT l.granted LIMIT 1),
       b.pid, b.state, left(regexp_replace(b.query, '\s+', ' ', 'g'), 120),
       floor(extract(epoch FROM now() - b.xact_start))::int
  FROM pg_stat_activity w
  LEFT JOIN pg_stat_activity b ON b.pid = (pg_blocking_pids(w.pid))[1]
 WHERE w.pid = %s
"""


def _say_what_migration_waits_for(
    dsn: str, backend: int, connect_timeout: int, done: threading.Event
) -> None:
    """Once the migration on ``backend`` has run :data:`MIGRATION_NOTICE_AFTER`, log once what
    it waits for: a lock and the session holding it, or its statement. Best effort: a failure
    to ask is only a debug line, and the migration's own bounds stand."""
    if done.wait(MIGRATION_NOTICE_AFTER.total_seconds()):
        return
    try:
        with command_connection(dsn, connect_timeout=connect_timeout) as conn:
            while not done.is_set():
                row = conn.execute(_WAITING, (backend,)).fetchone()
                if done.is_set():
                    return
                if row is not None and row[0] == "Lock" and row[3] is not None:
                    _, _, what, pid, state, query, seconds = row
                    log.warning(
                        "the start-up migration waits for %s, held by the session of pid %s "
                        "(%s for %ss, last statement: %s); it gives up after %s",
                        what or "a lock",
                        pid,
                        state,
                        seconds,
                        query,
                        format_duration(MIGRATION_LOCK_WAIT),
                    )
                    return
                if done.wait(MIGRATION_NOTICE_AFTER.total_seconds()):
                    return
    except psycopg.Error as error:
        log.debug("could not see what the start-up migration waits for: %s", error)


def refuse_unbindable(args: argparse.Namespace, config: ServiceConfig) -> None:
    """Refuse an address the service cannot listen on before the start does anything (migrates):
    a usage error naming --host when the option gave it, else the configuration's error."""
    from pgonce.service.runner import host_problem

    problem = host_problem(config.host)
    if problem is None:
        return
    parser = getattr(args, "parser", None)
    if getattr(args, "host", None) is not None and parser is not None:
        parser.error(f"--host {args.host}: {problem}")
    raise ConfigError(f"[server] host {config.host!r}: {problem}")


def refuse_idle(config: ServiceConfig, parts: tuple[str, ...]) -> None:
    """Refuse to start a command that has nothing to do, naming the section to add."""
    where = (
        f"the configuration ({config.origin})"
        if config.origin != "environment"
        else "no configuration file was given (--config or $PGONCE_CONFIG), so it"
    )
    if parts == ("relay",) and config.outbox is None:
        raise ConfigError(
            f"pgonce relay has nothing to publish: {where} has no [outbox] section; add one "
            'naming the broker, e.g. [outbox] publisher = "rabbitmq" (or nats, redis, http) '
            'with url = "env:BROKER_URL"'
        )
    if parts == ("workers",) and not any(s.source.handles for s in config.sources):
        raise ConfigError(
            f"pgonce worker has no handler to run: {where} has no source with a handler; add "
            'one, e.g. [sources.shop] with handler = "myapp.webhooks:on_shop_event"'
        )


async def _setup_demo(dsn: str) -> None:
    from pgonce.service import demo as service_demo

    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await service_demo.setup(conn)


def demo_source(config: ServiceConfig) -> tuple[str, SigningScheme]:
    """The source a demo storm goes to: the first with a handler, whose scheme can sign."""
    chosen = next((s.source for s in config.sources if s.source.handles), None)
    if chosen is None:
        raise ConfigError(
            "the demo needs a source with a handler, e.g. [sources.shop] with scheme = "
            '"standard-webhooks", secrets = ["env:NAME"] and handler = '
            '"pgonce.service.demo:record_order"'
        )
    if not hasattr(chosen.scheme, "sign"):
        raise ConfigError(f"the demo: the scheme of source {chosen.name!r} cannot sign")
    return chosen.name, cast(SigningScheme, chosen.scheme)


async def fire_storm(
    config: ServiceConfig, dsn: str, url: str, orders: int, copies: int, *, where: str = ""
) -> bool:
    """A signed retry storm at the service at ``url``; prints the proof, True when exactly once."""
    from pgonce.service import demo as service_demo

    with needs("server", "the demo"):
        from psycopg_pool import AsyncConnectionPool

    with needs("http", "the demo"):
        import httpx

    name, scheme = demo_source(config)
    url = service_demo.service_url(url, name)
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        async with pool.connection() as conn:
            await service_demo.check_setup(conn, where or "the database")
        say(
            f"pgonce demo: {orders * copies} signed deliveries of {orders} orders to "
            f"{public(url)} ({name})"
        )
        try:
            report = await service_demo.storm(url, name, scheme, pool, orders=orders, copies=copies)
        except httpx.HTTPError as error:  # --url names no running service
            raise UsageError(f"cannot reach {public(url)}: {error}") from None
    print_proof(
        report.proof(), seconds=report.seconds, items=report.deliveries, ok=report.exactly_once
    )
    return report.exactly_once


def _demo(
    config: ServiceConfig, dsn: str, orders: int, copies: int
) -> Callable[[Running], Coroutine[Any, Any, None]]:
    demo_source(config)  # refuse a configuration without a usable source before starting

    async def fire(running: Running) -> None:
        await fire_storm(config, dsn, running.url, orders, copies)
        say(f"pgonce: still serving on {running.url} (Ctrl-C stops)")

    return fire


def run(args: argparse.Namespace) -> int:
    from pgonce.service.runner import PARTS

    return run_parts(args, PARTS)
