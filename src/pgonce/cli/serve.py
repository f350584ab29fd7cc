"""Run the service: webhook inbox, inbox workers, outbox relay, sweeper, health, metrics, admin.

One process runs every part; `pgonce worker` and `pgonce relay` run one part alone, so that a
deployment scales each separately. The configuration is a TOML file (--config or $PGONCE_CONFIG;
see examples/pgonce.toml); every value can be overridden from the environment as
PGONCE__SECTION__KEY. Invalid configuration is refused with every problem listed.

HTTP: POST /webhooks/{source}, GET /healthz (alive), GET /readyz (database reachable and migrated),
GET /metrics (Prometheus), /admin (only when [admin] token is configured).

SIGTERM or SIGINT stops accepting, lets in-flight work finish or roll back, and exits 0.
With --demo the service fires a signed retry storm at itself once it is up and prints the proof.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import psycopg

from pgonce.cli.common import add_database_options, print_proof, say
from pgonce.database import open_database
from pgonce.errors import ConfigError
from pgonce.extras import needs
from pgonce.store.errors import translate_errors
from pgonce.store.migrate import migrate
from pgonce.webhooks.schemes.base import SigningScheme

if TYPE_CHECKING:
    from pgonce.service.config import ServiceConfig
    from pgonce.service.runner import Running

# The service's modules are imported by the functions that run it, so that `pgonce --help` and the
# core commands work without the `server` extra; running without it raises MissingExtra.

NAME = "serve"
HELP = "run the service: webhook inbox, workers, relay, sweeper, metrics, admin"


def add_service_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="TOML configuration file (default: $PGONCE_CONFIG)"
    )
    add_database_options(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    add_service_options(parser)
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000; 0 picks one)")
    parser.add_argument(
        "--demo",
        action="store_true",
        help="once up, fire a signed retry storm at the first source with a handler and print "
        "the exactly-once proof",
    )
    parser.add_argument("--demo-orders", type=int, default=100, help="orders in the storm")
    parser.add_argument("--demo-copies", type=int, default=5, help="deliveries of each order")


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """The configuration file and environment, with the command line's options on top."""
    from pgonce.service.config import load

    config = load(args.config)
    settings = config.settings
    overrides = {
        "dsn": getattr(args, "dsn", None),
        "schema": getattr(args, "schema", None),
        "data_dir": getattr(args, "data_dir", None),
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        settings = replace(settings, **given)
    top = {
        k: v
        for k, v in (("host", getattr(args, "host", None)), ("port", getattr(args, "port", None)))
        if v is not None
    }
    return replace(config, settings=settings, **top)


def run_parts(args: argparse.Namespace, parts: Iterable[str]) -> int:
    from pgonce.service import logs, runner

    config = service_config(args)
    logs.configure(config.log_format)
    with open_database(config.settings) as db:
        say(f"pgonce: using {db.description}; configuration from {config.origin}")
        with translate_errors("connecting"), psycopg.connect(db.dsn, autocommit=True) as conn:
            applied = migrate(conn, config.settings.schema)
        if applied:
            say(f"pgonce: applied migrations {', '.join(f'{v:04d}' for v in applied)}")
        on_ready = None
        if getattr(args, "demo", False):
            on_ready = _demo(config, db.dsn, args.demo_orders, args.demo_copies)
            asyncio.run(_setup_demo(db.dsn))
        asyncio.run(runner.run(config, db.dsn, parts=parts, on_ready=on_ready))
    say("pgonce: stopped")
    return 0


async def _setup_demo(dsn: str) -> None:
    from pgonce.service import demo as service_demo

    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await service_demo.setup(conn)


def demo_source(config: ServiceConfig) -> tuple[str, SigningScheme]:
    """The source a demo storm goes to: the first with a handler, whose scheme can sign."""
    chosen = next((s.source for s in config.sources if s.source.handles), None)
    if chosen is None:
        raise ConfigError("the demo needs a source with a handler (see examples/pgonce.toml)")
    if not hasattr(chosen.scheme, "sign"):
        raise ConfigError(f"the demo: the scheme of source {chosen.name!r} cannot sign")
    return chosen.name, cast(SigningScheme, chosen.scheme)


async def fire_storm(config: ServiceConfig, dsn: str, url: str, orders: int, copies: int) -> bool:
    """A signed retry storm at the service at ``url``; prints the proof, True when exactly once."""
    from pgonce.service import demo as service_demo

    with needs("server", "the demo"):
        from psycopg_pool import AsyncConnectionPool

    name, scheme = demo_source(config)
    say(f"pgonce demo: {orders * copies} signed deliveries of {orders} orders to {url} ({name})")
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        report = await service_demo.storm(url, name, scheme, pool, orders=orders, copies=copies)
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
