"""The service's configuration: one TOML file, every value overridable by the environment.

- The file is ``--config`` or ``$PGONCE_CONFIG``. Without one, the service runs with defaults and
  no webhook sources.
- ``PGONCE__SECTION__KEY=value`` overrides ``[section] key`` (double underscores separate the path:
  ``PGONCE__SERVER__PORT=9000``, ``PGONCE__SOURCES__SHOP__TOLERANCE=10m``). ``PGONCE_DSN``,
  ``PGONCE_SCHEMA``, ``PGONCE_DATA_DIR``, ``PGONCE_POOLER`` and ``PGONCE_LISTEN_DSN`` keep
  working as everywhere else in pgonce.
- Secrets are never written in the file: a secret setting holds ``env:NAME``, the name of the
  environment variable that holds it. pgonce never prints a secret, only the variable's name.
- Invalid configuration is refused at start with **every** problem listed (file, key, why), not
  just the first.
"""

from __future__ import annotations

import importlib
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pgonce.config import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_DATA_DIR,
    DEFAULT_POOL_WAIT,
    DEFAULT_SCHEMA,
    POOLERS,
    Settings,
)
from pgonce.core.inbox import Ordering, RetryPolicy
from pgonce.core.leases import DEFAULT_LEASE, MIN_LEASE
from pgonce.core.retention import (
    DEFAULT_RETENTION,
    DEFAULT_RETRY_HORIZON,
    DEFAULT_SWEEP_EVERY,
    TARGETS,
    Retention,
    RetentionPolicy,
    format_duration,
    parse_duration,
)
from pgonce.errors import ConfigError, PgonceError
from pgonce.extras import needs
from pgonce.publishers.base import msg_id_prefix_problem
from pgonce.store._async.phases import (
    DEFAULT_COMPLETE_EVERY,
    DEFAULT_COMPLETE_MAX_AGE,
    DEFAULT_RETIRE_AFTER,
    Work,
)
from pgonce.store.errors import first_line
from pgonce.webhooks.schemes import SCHEMES, build_scheme
from pgonce.webhooks.source import Handler, OrderingExtractor, Source

#: Loopback by default: a service that receives webhooks is put behind a proxy on purpose, never
#: exposed on every interface by accident.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

#: How long a stop (SIGTERM or SIGINT) waits for the requests and inbox handlers under way before
#: it cuts them (a delivery is answered 503, a handler's batch rolls back; nothing acknowledged
#: is lost either way). 30 s, uvicorn's and Kubernetes' customary grace: set it below the grace
#: your orchestrator gives before SIGKILL, so that the stop answers what it cuts.
DEFAULT_STOP_TIMEOUT = timedelta(seconds=30)

#: Inbox workers per process. Four keeps a handler that waits on I/O from stalling the rest while
#: staying far below a small database's connection limit.
DEFAULT_WORKERS = 4

#: The service's pool (HTTP requests, the admin page, the sweeper): connections kept open. Two,
#: so that the first requests after a quiet spell never wait for a connect.
DEFAULT_POOL_MIN_SIZE = 2

#: The most connections the pool opens. A request holds one for a few milliseconds; ten serve
#: thousands of requests a second while leaving room for several processes under a small
#: server's 100 max_connections.
DEFAULT_POOL_MAX_SIZE = 10

#: The shortest interval of the sweeper and of the completer. Their work is measured in minutes
#: and seconds; below a second is a slip ("1ms" for "1m") that ran a sweep, each batch a
#: transaction and a log line, dozens of times a second.
MIN_INTERVAL = timedelta(seconds=1)

ENV_PREFIX = "PGONCE__"
_ENV_SECRET = re.compile(r"^env:([A-Za-z_][A-Za-z0-9_]*)$")
T = TypeVar("T")


@dataclass(frozen=True)
class SourceConfig:
    """A webhook source, and how long its deliveries are kept."""

    source: Source
    retention: Retention


@dataclass(frozen=True)
class OutboxConfig:
    """Where the relay publishes the outbox: one publisher per service."""

    #: "rabbitmq", "nats", "redis" or "http".
    publisher: str
    #: The broker's URL (or, for "http", the webhook endpoint). May hold credentials: it is read
    #: from the environment when written "env:NAME", and never printed.
    url: str = field(repr=False)
    #: RabbitMQ: the exchange ("" is the default exchange: the routing key names the queue).
    exchange: str = ""
    #: RabbitMQ: declare the exchange (or, on the default exchange, a queue per routing key)
    #: instead of only checking that it exists.
    declare: bool = False
    #: "http": the Standard Webhooks signing secret (whsec_...), from the environment.
    secret: str | None = field(default=None, repr=False)
    #: RabbitMQ: the largest message body sent, in bytes; a larger one is refused (and parked
    #: in the end) instead of closing the channel. The broker's ``max_message_size``: 128 MiB by
    #: default in RabbitMQ 3.x, 16 MiB in 4.x (a lower limit of the broker's is learnt from its
    #: first refusal).
    max_message_size: int = 128 * 1024 * 1024
    #: NATS: what ``Nats-Msg-Id`` starts with before the outbox id, instead of the outbox's
    #: origin (a hash of the cluster's system identifier, the database and the schema); ""
    #: keeps the origin.
    msg_id_prefix: str = ""
    #: Relays in this process; several share the rows without double publishing.
    relays: int = 1
    #: How long published rows are kept before the sweeper deletes them.
    retention: timedelta = timedelta(days=7)


PUBLISHERS = ("rabbitmq", "nats", "redis", "http")
#: The [outbox] options that belong to one publisher, and which one.
_PUBLISHER_OPTIONS = {
    "exchange": "rabbitmq",
    "declare": "rabbitmq",
    "max_message_size": "rabbitmq",
    "msg_id_prefix": "nats",
    "secret": "http",
}
#: The brokers' usual local addresses; the RabbitMQ one carries its well-known default login.
DEFAULT_PUBLISHER_URLS = {
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672/",
    "nats": "nats://127.0.0.1:4222",
    "redis": "redis://127.0.0.1:6379/0",
}


@dataclass(frozen=True)
class PoolConfig:
    """The service's connection pool: its sizes and how long anything may wait for it."""

    min_size: int = DEFAULT_POOL_MIN_SIZE
    max_size: int = DEFAULT_POOL_MAX_SIZE
    connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT
    #: How long a request waits for a pool connection before the 503.
    wait: timedelta = DEFAULT_POOL_WAIT


@dataclass(frozen=True)
class CompleterConfig:
    """The completer: finishes two-phase requests abandoned mid-way, from their recovery point."""

    #: The registered operations by name (``start(operation=...)``): async work functions,
    #: configured as ``module:function``.
    operations: Mapping[str, Work] = field(default_factory=dict)
    every: timedelta = DEFAULT_COMPLETE_EVERY
    max_age: timedelta = DEFAULT_COMPLETE_MAX_AGE
    retire_after: int = DEFAULT_RETIRE_AFTER
    #: The lease of the completer's own takeovers (the application's store has its own).
    lease: timedelta = DEFAULT_LEASE


@dataclass(frozen=True)
class ServiceConfig:
    settings: Settings = field(default_factory=Settings)
    #: A direct connection (not through a transaction-mode pooler) for LISTEN, which wakes the
    #: inbox workers and the relay as soon as a row arrives; None takes ``settings.listen_dsn``
    #: ($PGONCE_LISTEN_DSN), else listens on the DSN.
    listen_dsn: str | None = field(default=None, repr=False)
    pool: PoolConfig = field(default_factory=PoolConfig)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    #: How long a stop waits for the requests, inbox handlers and relay batches under way.
    stop_timeout: timedelta = DEFAULT_STOP_TIMEOUT
    sources: tuple[SourceConfig, ...] = ()
    workers: int = DEFAULT_WORKERS
    keys_retention: Retention = field(default_factory=Retention)
    sweep_every: timedelta = DEFAULT_SWEEP_EVERY
    #: The admin page is off unless a credential is configured (``[admin] token = "env:NAME"``).
    admin_token: str | None = field(default=None, repr=False)
    #: The outbox relay; None runs no relay.
    outbox: OutboxConfig | None = None
    #: The completer of two-phase requests; None (no operation registered) runs none.
    completer: CompleterConfig | None = None
    #: "json", "text", or "auto" (text on a terminal, JSON lines otherwise).
    log_format: str = "auto"
    #: Where the configuration came from, for messages.
    origin: str = "defaults"
    #: How long each source's deliveries are kept, by source name: read from the file even where
    #: ``sources`` is left empty because the command did not read the sources' secrets.
    source_retention: Mapping[str, Retention] = field(default_factory=dict)

    def retention_policies(self) -> list[RetentionPolicy]:
        """One policy per sweep target: keys by scope, the inbox by source."""
        policies = [RetentionPolicy("keys", self.keys_retention)]
        if "inbox" in TARGETS:
            policies.append(
                RetentionPolicy(
                    "inbox",
                    Retention(),
                    {s.source.name: s.retention for s in self.sources}
                    | dict(self.source_retention),
                )
            )
        if "outbox" in TARGETS:
            keep = self.outbox.retention if self.outbox else DEFAULT_RETENTION
            policies.append(RetentionPolicy("outbox", Retention(keep, timedelta(0))))
        return policies


class _Problems:
    """Collects every problem of a configuration, so that all are reported at once."""

    def __init__(
        self,
        origin: str,
        environ: Mapping[str, str],
        *,
        secrets: bool = True,
        handlers: bool = True,
    ) -> None:
        self.origin = origin
        #: Where env:NAME references are looked up.
        self.environ = environ
        #: False: a reference to a variable that is not set is no problem (see load()).
        self.secrets = secrets
        #: False: "module:function" references are checked for their form, not imported.
        self.handlers = handlers
        self.items: list[str] = []
        #: The keys ``PGONCE__...`` variables set (by the variable's name), and the file's keys.
        self.overrides: dict[str, str] = {}
        self.file_keys: set[str] = set()

    def add(self, key: str, why: str) -> None:
        self.items.append(f"{self.where(key)}: {key}: {why}")

    def where(self, key: str) -> str:
        """The variable that set ``key`` (or, for a table the file does not have, one of its
        keys), else the file: the operator is sent where the value was written."""
        if key in self.overrides:
            return self.overrides[key]
        if key not in self.file_keys:
            for path, name in sorted(self.overrides.items()):
                if path.startswith(f"{key}."):
                    return name
        return self.origin

    def check(self, key: str, build: Callable[[], T]) -> T | None:
        """Run ``build``; a pgonce error it raises becomes a problem of ``key``."""
        try:
            return build()
        except PgonceError as error:
            self.add(key, str(error))
            return None


class _FromEnvironment(str):
    """A value a ``PGONCE__...`` variable set: already in the environment, so a secret (a DSN, a
    broker URL with its password) may be written there as it is, not only as "env:NAME"."""

    __slots__ = ()


def _keys(data: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every dotted key of a parsed file, tables included."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        yield key
        if isinstance(value, dict):
            yield from _keys(value, f"{key}.")


def _env_overrides(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """Apply the ``PGONCE__...`` variables to ``data``; the keys they set, by variable name."""
    overrides: dict[str, str] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__") if part]
        target = data
        for part in path[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                break
        else:
            if path:
                target[path[-1]] = _FromEnvironment(value)
                overrides[".".join(path)] = name
    return overrides


class _Section:
    """Typed reads of one table of the file, each failure recorded as a problem."""

    def __init__(self, data: Any, path: str, problems: _Problems) -> None:
        self.path = path
        self.problems = problems
        if data is None:
            data = {}
        if not isinstance(data, dict):
            problems.add(path, "must be a table")
            data = {}
        self.data: dict[str, Any] = data
        self.read: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def raw(self, name: str) -> Any:
        self.read.add(name)
        return self.data.get(name)

    def text(self, name: str, default: str) -> str:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            self.problems.add(self.key(name), "must be a non-empty string")
            return default
        return value

    def optional_text(self, name: str) -> str | None:
        value = self.raw(name)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            self.problems.add(self.key(name), "must be a non-empty string")
            return None
        return value

    def integer(self, name: str, default: int, *, low: int = 1, high: int = 2**31) -> int:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.problems.add(self.key(name), f"must be a whole number from {low} to {high}")
            return default
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            self.problems.add(self.key(name), "must be true or false")
            return default
        return value

    def duration(self, name: str, default: timedelta, *, zero: bool = False) -> timedelta:
        """A duration with its unit ("30s", "3d"); longer than 0s unless ``zero`` allows 0s."""
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, int | float) and not isinstance(value, bool):
            # A bare number has no unit: 3 may mean seconds, days or a typo; never guess.
            self.problems.add(
                self.key(name), 'must be a duration with its unit, e.g. "3d", "72h" or "30s"'
            )
            return default
        if not isinstance(value, str):
            self.problems.add(self.key(name), "must be a duration such as 30s, 5m, 72h or 30d")
            return default
        parsed = self.problems.check(self.key(name), lambda: parse_duration(value))
        if parsed is None:
            return default
        if parsed < timedelta(0) or (parsed == timedelta(0) and not zero):
            self.problems.add(
                self.key(name), "must not be negative" if zero else "must be longer than 0s"
            )
            return default
        return parsed

    def secrets(self, name: str) -> list[str]:
        value = self.raw(name)
        if value is None:
            return []
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            self.problems.add(self.key(name), 'must be "env:NAME" or a list of them')
            return []
        found = []
        for item in values:
            secret = _secret(item, self.key(name), self.problems)
            if secret is not None:
                found.append(secret)
        return found

    def unknown(self, allowed: set[str] | None = None) -> None:
        for name in sorted(set(self.data) - (allowed or self.read)):
            self.problems.add(self.key(name), "is not a known setting")

    def tables(self, name: str) -> Iterator[tuple[str, _Section]]:
        value = self.raw(name) or {}
        if not isinstance(value, dict):
            self.problems.add(self.key(name), "must be a table of tables")
            return
        for child, data in value.items():
            yield child, _Section(data, f"{self.key(name)}.{child}", self.problems)


def _secret(value: str, key: str, problems: _Problems, *, needed: bool = False) -> str | None:
    """The secret a setting names; None, with a problem recorded, when it cannot be read.

    Where the command does not use the service's secrets (``load(secrets=False)``) a variable
    that is not set is no problem, unless the setting is ``needed`` (the DSN). A value written
    in place of a reference is refused either way: the file must not hold secrets.
    """
    match = _ENV_SECRET.match(value)
    if not match and isinstance(value, _FromEnvironment):
        return str(value)  # the environment's own value: that is where secrets belong
    if not match:
        # Never echo the value: it may be the secret itself, pasted where a reference belongs.
        problems.add(
            key, 'secrets are given by reference: write "env:NAME" (the value was not shown)'
        )
        return None
    secret = problems.environ.get(match[1])
    if not secret and (problems.secrets or needed):
        problems.add(key, f"the environment variable {match[1]} is not set")
    if not secret:
        return None
    return secret


def _credentials_in(url: str) -> str | None:
    """Why a URL written in the file may hold a credential (a login, a token in the query), or
    None. Such a URL belongs in the environment; the reason never repeats the URL."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "is not a valid URL (the value was not shown)"
    if "@" in parts.netloc:
        where = "a login (user or password before '@')"
    elif parts.query or "?" in url:
        where = "a query string (where tokens travel)"
    else:
        return None
    return (
        f"holds {where}: credentials are not written in the file; put the URL in an environment "
        'variable and write "env:NAME" (the value was not shown)'
    )


def _forward_to(url: str) -> Handler:
    """forward_to(url), imported here: it needs the ``http`` extra, which the commands that read
    only the database settings (``pgonce migrate``, ``sweep``) must not require."""
    with needs("http", "forwarding webhooks (forward = ...)"):
        from pgonce.webhooks.forward import forward_to

    return forward_to(url)


def _import_handler(spec: str, key: str, problems: _Problems) -> Handler | None:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        problems.add(key, f"{spec!r} is not of the form module:function")
        return None
    if not problems.handlers:
        return None  # a command that runs no handler need not have the application's code
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        problems.add(key, f"cannot import {module_name!r}: {error}")
        return None
    except Exception as error:  # the module's own code failed while it was imported
        problems.add(
            key, f"importing {module_name!r} raised {type(error).__name__}: {first_line(error)}"
        )
        return None
    handler = getattr(module, attribute, None)
    if not callable(handler):
        problems.add(key, f"{module_name!r} has no callable {attribute!r}")
        return None
    return handler  # type: ignore[no-any-return]


def _interval(section: _Section, default: timedelta) -> timedelta:
    """A section's ``every``: a duration of at least :data:`MIN_INTERVAL`."""
    every = section.duration("every", default)
    if every < MIN_INTERVAL:
        section.problems.add(
            section.key("every"),
            f"must be at least {format_duration(MIN_INTERVAL)} (is {format_duration(every)} "
            "a slip for minutes, m?)",
        )
        return default
    return every


def _completer(section: _Section) -> CompleterConfig | None:
    """``[completer]``; None when it registers no operation (there is nothing to complete)."""
    every = _interval(section, DEFAULT_COMPLETE_EVERY)
    max_age = section.duration("max_age", DEFAULT_COMPLETE_MAX_AGE)
    retire_after = section.integer("retire_after", DEFAULT_RETIRE_AFTER, high=1000)
    lease = section.duration("lease", DEFAULT_LEASE)
    if lease < MIN_LEASE:
        section.problems.add(section.key("lease"), "must be at least 1s")
    specs = section.raw("operations") or {}
    section.unknown()
    if not isinstance(specs, dict):
        section.problems.add(section.key("operations"), 'is a table of name = "module:function"')
        return None
    operations: dict[str, Work] = {}
    for name, spec in specs.items():
        key = f"{section.key('operations')}.{name}"
        if not isinstance(spec, str):
            section.problems.add(key, 'must be "module:function"')
            continue
        work = _import_handler(spec, key, section.problems)
        if work is not None:
            operations[name] = work  # type: ignore[assignment]
    if not operations:
        return None
    return CompleterConfig(operations, every, max_age, retire_after, lease)


def json_pointer(pointer: str) -> Callable[[Any], Any]:
    """A getter for RFC 6901 ``pointer`` (``/data/object/id``); it returns ``None`` if absent."""
    if pointer and not pointer.startswith("/"):
        raise ConfigError(f"{pointer!r} is not a JSON pointer (it starts with '/')")
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]

    def get(document: Any) -> Any:
        for part in parts:
            if isinstance(document, dict):
                document = document.get(part)
            elif isinstance(document, list) and part.isdigit() and int(part) < len(document):
                document = document[int(part)]
            else:
                return None
        return document

    return get


def ordering_from_pointers(key_pointer: str, version_pointer: str | None) -> OrderingExtractor:
    """Ordering by the JSON values at ``key_pointer`` (and ``version_pointer``, an integer)."""
    key_of = json_pointer(key_pointer)
    version_of = json_pointer(version_pointer) if version_pointer else None

    def extract(payload: Any, headers: Mapping[str, str]) -> Ordering | None:
        key = key_of(payload)
        if key is None or isinstance(key, dict | list):
            return None
        version = version_of(payload) if version_of else None
        return Ordering(str(key), version if isinstance(version, int) else None)

    return extract


_SOURCE_KEYS = {
    "scheme",
    "secrets",
    "tolerance",
    "options",
    "body_limit",
    "json_required",
    "handler",
    "forward",
    "ordering_key",
    "ordering_version",
    "out_of_order",
    "head_failure",
    "attempts",
    "retry_base",
    "retry_cap",
    "handler_timeout",
    "retention",
    "retry_horizon",
}


def _source(name: str, section: _Section) -> tuple[SourceConfig | None, Retention]:
    """The source a section describes (None when it has problems, or when its secrets were not
    read), and how long its deliveries are kept."""
    problems = section.problems
    before = len(problems.items)
    scheme_name = section.text("scheme", "")
    if scheme_name and scheme_name not in SCHEMES:
        problems.add(section.key("scheme"), f"unknown scheme; known: {', '.join(SCHEMES)}")
    secrets = section.secrets("secrets")
    if not scheme_name:
        problems.add(section.key("scheme"), "is required")
    if not secrets and section.raw("secrets") is None:
        problems.add(section.key("secrets"), 'is required ("env:NAME", or a list for rotation)')
    tolerance = section.duration("tolerance", timedelta(minutes=5))
    options = section.raw("options")
    handler_spec = section.optional_text("handler")
    forward = section.optional_text("forward")
    handler: Handler | None = None
    if handler_spec and forward:
        problems.add(section.key("handler"), "give either handler or forward, not both")
    elif handler_spec:
        handler = _import_handler(handler_spec, section.key("handler"), problems)
    elif forward:
        if not forward.startswith(("http://", "https://")):
            problems.add(section.key("forward"), "must be an http:// or https:// URL")
        elif not isinstance(forward, _FromEnvironment) and (
            (why := _credentials_in(forward)) is not None
        ):
            problems.add(section.key("forward"), why)
        elif problems.secrets and problems.handlers:  # nor need a command that runs none
            handler = problems.check(section.key("forward"), lambda: _forward_to(forward))
    key_pointer = section.optional_text("ordering_key")
    version_pointer = section.optional_text("ordering_version")
    ordering = None
    if version_pointer and not key_pointer:
        # Versions are compared within an ordering key: without one, nothing would be ordered.
        problems.add(
            section.key("ordering_version"),
            "needs ordering_key (the versions are compared within an ordering key): add "
            "ordering_key, or remove ordering_version",
        )
    if key_pointer:
        ordering = problems.check(
            section.key("ordering_key"),
            lambda: ordering_from_pointers(key_pointer, version_pointer),
        )
    retry = problems.check(
        section.key("attempts"),
        lambda: RetryPolicy(
            attempts=section.integer("attempts", RetryPolicy().attempts),
            base=section.duration("retry_base", RetryPolicy().base),
            cap=section.duration("retry_cap", RetryPolicy().cap),
        ),
    )
    retention = Retention(
        keep=section.duration("retention", DEFAULT_RETENTION),
        retry_horizon=section.duration("retry_horizon", DEFAULT_RETRY_HORIZON, zero=True),
    )
    if retention.keep < retention.retry_horizon:
        problems.add(
            section.key("retention"),
            f"{format_duration(retention.keep)} is shorter than the provider's retry horizon of "
            f"{format_duration(retention.retry_horizon)}: a redelivery after "
            f"{format_duration(retention.keep)} would be processed again",
        )
    body_limit = section.integer("body_limit", 1024 * 1024)
    json_required = section.boolean("json_required", True)
    out_of_order = section.text("out_of_order", "process")
    head_failure = section.text("head_failure", "block")
    # Judged here, each under its key: the source's own check named only the first of them.
    if out_of_order not in ("process", "drop"):
        problems.add(section.key("out_of_order"), "is process or drop")
    if head_failure not in ("block", "park"):
        problems.add(section.key("head_failure"), "is block or park")
    handler_timeout = section.duration("handler_timeout", timedelta(seconds=30))
    section.unknown(_SOURCE_KEYS)
    if len(problems.items) != before or retry is None:
        return None, retention
    if not secrets and not problems.secrets:  # its secrets were not read: not built
        return None, retention
    scheme = problems.check(
        section.key("scheme"),
        lambda: build_scheme(
            scheme_name, secrets, tolerance=tolerance, options=options if options else None
        ),
    )
    if scheme is None:
        return None, retention
    source = problems.check(
        section.path,
        lambda: Source(
            name=name,
            scheme=scheme,
            handler=handler,
            body_limit=body_limit,
            json_required=json_required,
            ordering=ordering,
            out_of_order=out_of_order,  # type: ignore[arg-type]
            head_failure=head_failure,  # type: ignore[arg-type]
            retry=retry,
            handler_timeout=handler_timeout,
        ),
    )
    return (SourceConfig(source, retention) if source else None), retention


def _outbox(section: _Section) -> OutboxConfig | None:
    problems = section.problems
    before = len(problems.items)
    publisher = section.text("publisher", "")
    if publisher not in PUBLISHERS:
        problems.add(section.key("publisher"), f"is one of {', '.join(PUBLISHERS)}")
    given = section.optional_text("url")
    url_value = given or DEFAULT_PUBLISHER_URLS.get(publisher)
    url = ""
    if url_value is None:
        if publisher in PUBLISHERS:  # an unknown one is said above, not taken for http
            problems.add(section.key("url"), "is required for the http publisher")
    elif url_value.startswith("env:"):
        url = _secret(url_value, section.key("url"), problems) or ""
    elif (
        given is not None
        and not isinstance(given, _FromEnvironment)
        and (why := _credentials_in(given)) is not None
    ):
        problems.add(section.key("url"), why)
    else:
        url = url_value
    if publisher in PUBLISHERS:
        for name, owner in _PUBLISHER_OPTIONS.items():
            # Taken silently, an option of another publisher let `exchange = "billing"` on
            # redis or nats send every event where the file does not say.
            if owner != publisher and section.data.get(name) is not None:
                section.read.add(name)
                problems.add(
                    section.key(name),
                    f"is an option of the {owner} publisher, not of {publisher}: remove it",
                )
    other = publisher in PUBLISHERS and publisher != "http"
    secret_ref = None if other else section.optional_text("secret")
    secret = _secret(secret_ref, section.key("secret"), problems) if secret_ref else None
    if publisher == "http" and secret_ref is None:
        problems.add(section.key("secret"), 'is required for the http publisher ("env:NAME")')
    config = OutboxConfig(
        publisher=publisher,
        url=url,
        exchange=section.text("exchange", ""),
        declare=section.boolean("declare", False),
        secret=secret,
        max_message_size=section.integer(
            "max_message_size", OutboxConfig.max_message_size, high=512 * 1024 * 1024
        ),
        msg_id_prefix=section.text("msg_id_prefix", ""),
        relays=section.integer("relays", 1, high=64),
        retention=section.duration("retention", timedelta(days=7)),
    )
    if (problem := msg_id_prefix_problem(config.msg_id_prefix)) is not None:
        problems.add(section.key("msg_id_prefix"), problem)
    section.unknown()
    return config if len(problems.items) == before else None


def _pool(section: _Section) -> PoolConfig:
    min_size = section.integer("pool_min_size", DEFAULT_POOL_MIN_SIZE, low=0, high=1000)
    max_size = section.integer("pool_max_size", DEFAULT_POOL_MAX_SIZE, high=1000)
    if max_size < min_size:
        section.problems.add(
            section.key("pool_max_size"), f"{max_size} is less than pool_min_size ({min_size})"
        )
    connect_timeout = section.duration("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
    if connect_timeout < timedelta(seconds=2) or connect_timeout % timedelta(seconds=1):
        section.problems.add(
            section.key("connect_timeout"),
            "must be whole seconds, at least 2s (libpq counts in seconds and reads 1 as 2)",
        )
        connect_timeout = DEFAULT_CONNECT_TIMEOUT
    wait = section.duration("pool_wait", DEFAULT_POOL_WAIT)
    if wait <= timedelta(0):
        section.problems.add(section.key("pool_wait"), "must be longer than 0s")
        wait = DEFAULT_POOL_WAIT
    return PoolConfig(min_size, max_size, connect_timeout, wait)


def _stop_timeout(section: _Section) -> timedelta:
    """``[server] stop_timeout``: whole seconds (uvicorn counts its graceful stop in seconds), at
    least one (below a second is a slip, "1ms" for "1m", that would cut every request a deploy
    finds under way)."""
    timeout = section.duration("stop_timeout", DEFAULT_STOP_TIMEOUT)
    if timeout < timedelta(seconds=1):
        why = f"must be at least 1s (is {format_duration(timeout)} a slip for minutes, m?)"
    elif timeout % timedelta(seconds=1):
        why = f"must be whole seconds, not {format_duration(timeout)} (the stop counts in seconds)"
    else:
        return timeout
    section.problems.add(section.key("stop_timeout"), why)
    return DEFAULT_STOP_TIMEOUT


def _unless_env(environ: Mapping[str, str], name: str, value: T | None) -> T | None:
    """``value`` from the file, or None when the environment variable ``name`` overrides it."""
    return None if environ.get(name) else value


def load(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    secrets: bool = True,
    handlers: bool = True,
) -> ServiceConfig:
    """Read the configuration; raise :class:`ConfigError` listing every problem found.

    ``secrets=False`` is for the commands that use only the database and the retention settings
    (``migrate``, ``doctor``, ``sweep``, ``replay``, ``events``): a deploy job that runs them
    need not hold the sources' signing secrets, the broker's URL or the admin token. A reference
    to a variable that is not set is then no problem, the sources are left out of ``sources``
    (their retention is in ``source_retention``) and the outbox's URL is empty; the DSN is still
    read, and everything else is checked as ``pgonce serve`` checks it.

    ``handlers=False`` is for the commands that run no handler and no completer operation (the
    ones above, and ``send``, which only signs): an operator's machine need not have the
    application's code. The ``module:function`` references are checked for their form only, and
    left out (no source has a handler; ``completer`` is None).
    """
    env = os.environ if environ is None else environ
    if path is None and env.get("PGONCE_CONFIG"):
        path = Path(env["PGONCE_CONFIG"])
    origin = str(path) if path else "environment"
    problems = _Problems(origin, env, secrets=secrets, handlers=handlers)
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such configuration file") from None
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"{path}: cannot read it: {error}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: not valid TOML: {error}") from None
    problems.file_keys = set(_keys(data))
    problems.overrides = _env_overrides(data, env)
    root = _Section(data, "", problems)

    database = _Section(root.raw("database"), "database", problems)
    # PGONCE_DSN, PGONCE_SCHEMA, ... win over the file's [database] keys, as every environment
    # override does; a reference the environment overrides is not resolved.
    dsn_ref = _unless_env(env, "PGONCE_DSN", database.optional_text("dsn"))
    dsn = _secret(dsn_ref, "database.dsn", problems, needed=True) if dsn_ref else None
    listen_ref = _unless_env(env, "PGONCE_LISTEN_DSN", database.optional_text("listen_dsn"))
    listen_dsn = _secret(listen_ref, "database.listen_dsn", problems) if listen_ref else None
    pooler = database.optional_text("pooler")
    if pooler is not None and pooler not in POOLERS:
        problems.add("database.pooler", f"is one of {', '.join(POOLERS)}")
        pooler = None
    schema = _unless_env(env, "PGONCE_SCHEMA", database.optional_text("schema"))
    data_dir = _unless_env(env, "PGONCE_DATA_DIR", database.optional_text("data_dir"))
    settings = problems.check(
        "database",
        lambda: Settings.from_env(
            env,
            dsn=dsn,
            schema=schema,
            data_dir=Path(data_dir) if data_dir else None,
            pooler=_unless_env(env, "PGONCE_POOLER", pooler),
            # True only: false in the file leaves PGONCE_REQUIRE_DSN=1 of the host in force.
            require_dsn=database.boolean("require_dsn", False) or None,
        ),
    )
    pool = _pool(database)
    database.unknown()

    server = _Section(root.raw("server"), "server", problems)
    host = server.text("host", DEFAULT_HOST)
    port = server.integer("port", DEFAULT_PORT, low=0, high=65535)
    log_format = server.text("log_format", "auto")
    if log_format not in ("auto", "json", "text"):
        problems.add("server.log_format", "is auto, json or text")
    stop_timeout = _stop_timeout(server)
    server.unknown()

    inbox = _Section(root.raw("inbox"), "inbox", problems)
    workers = inbox.integer("workers", DEFAULT_WORKERS, high=256)
    inbox.unknown()

    keys = _Section(root.raw("keys"), "keys", problems)
    keys_retention = Retention(
        keep=keys.duration("retention", DEFAULT_RETENTION),
        retry_horizon=keys.duration("retry_horizon", DEFAULT_RETRY_HORIZON, zero=True),
    )
    if keys_retention.keep < keys_retention.retry_horizon:
        problems.add(
            "keys.retention",
            f"{format_duration(keys_retention.keep)} is shorter than the clients' retry horizon "
            f"of {format_duration(keys_retention.retry_horizon)}",
        )
    keys.unknown()

    sweeper = _Section(root.raw("sweeper"), "sweeper", problems)
    sweep_every = _interval(sweeper, DEFAULT_SWEEP_EVERY)
    sweeper.unknown()

    completer = _completer(_Section(root.raw("completer"), "completer", problems))

    # An empty [outbox] is a section with its keys missing, reported as such, not no section.
    outbox_data = root.raw("outbox")
    outbox = _outbox(_Section(outbox_data, "outbox", problems)) if outbox_data is not None else None

    admin = _Section(root.raw("admin"), "admin", problems)
    token_ref = admin.optional_text("token")
    admin_token = _secret(token_ref, "admin.token", problems) if token_ref else None
    admin.unknown()

    sources = []
    source_retention = {}
    for name, section in root.tables("sources"):
        found, source_retention[name] = _source(name, section)
        if found is not None:
            sources.append(found)
    root.unknown(
        {"database", "server", "inbox", "keys", "sweeper", "completer", "admin", "sources"}
        | {"outbox"}
    )

    if problems.items:
        count = len(problems.items)
        raise ConfigError(
            f"the configuration has {count} problem{'s' if count > 1 else ''}:\n  "
            + "\n  ".join(problems.items)
        )
    assert settings is not None
    return ServiceConfig(
        settings=settings,
        listen_dsn=listen_dsn,
        pool=pool,
        host=host,
        port=port,
        stop_timeout=stop_timeout,
        sources=tuple(sources),
        workers=workers,
        keys_retention=keys_retention,
        sweep_every=sweep_every,
        admin_token=admin_token,
        outbox=outbox,
        completer=completer,
        log_format=log_format,
        origin=origin,
        source_retention=source_retention,
    )


__all__ = [
    "DEFAULT_DATA_DIR",
    "DEFAULT_SCHEMA",
    "PoolConfig",
    "ServiceConfig",
    "SourceConfig",
    "load",
]
