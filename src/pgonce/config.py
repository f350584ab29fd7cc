"""Where pgonce's settings come from, and why each default is what it is.

Every setting has one name, read from the environment as ``PGONCE_<NAME>`` and overridable by the
command line. The service adds its TOML file on top of this (its own issue); the library needs only
what is here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from pgonce.core.frozen import refuse_changes
from pgonce.errors import ConfigError

#: All of pgonce's tables live in this PostgreSQL schema inside the application's database, so
#: they share transactions with the application's own tables without mixing names with them.
DEFAULT_SCHEMA = "pgonce"

#: Where the embedded PostgreSQL keeps its data when no DSN is given: a project-local folder,
#: reused on the next start, and git-ignored.
DEFAULT_DATA_DIR = Path(".pgonce") / "data"

#: How long a duplicate waits for the original request's transaction before it is told "in flight".
#: Most originals commit within milliseconds; two seconds covers a slow handler without letting a
#: retry storm hold the pool's connections for long.
DEFAULT_CLAIM_WAIT = timedelta(seconds=2)

#: The shortest claim wait allowed. The wait is PostgreSQL's lock_timeout around the claim's INSERT,
#: and it bounds every lock that INSERT waits for -- also the short ones on index pages and on
#: relation extension that a brand-new key can meet under load. With 1 ms, new keys were reported
#: "in flight" under a benchmark's load; 100 ms never was.
MIN_CLAIM_WAIT = timedelta(milliseconds=100)

#: What an in-flight duplicate is told to wait before retrying (Retry-After, in seconds).
DEFAULT_RETRY_AFTER = 1

#: psycopg prepares a statement after it ran this many times on one connection. PgBouncer in
#: transaction mode (before 1.21) cannot keep prepared statements: set it to none there.
DEFAULT_PREPARE_THRESHOLD: int | None = 5

#: What stands between pgonce and PostgreSQL, and so whether statements may be prepared.
#: ``auto``: the service checks at start whether connections share server sessions (a
#: transaction-mode pooler) and, if they do, runs as ``pgbouncer-transaction``; the library
#: switches when a prepared statement of its own meets another client's, and an inbox worker or
#: relay it runs lets psycopg prepare nothing where its first connection reached a pooler or a
#: proxy (:func:`pgonce.database.own_prepare_threshold`). ``none``: a direct
#: connection, or a pooler that keeps prepared statements per client (PgBouncer >= 1.21 with
#: ``max_prepared_statements``): nothing is checked. ``pgbouncer-transaction``: no prepared
#: statements at all, neither pgonce's nor psycopg's (``prepare_threshold = None``).
POOLERS = ("auto", "none", "pgbouncer-transaction")
DEFAULT_POOLER = "auto"
TRANSACTION_POOLER = "pgbouncer-transaction"

#: How long opening one connection may take (libpq's connect_timeout, whole seconds, at least
#: 2). A server that is up answers in milliseconds; a dead host (the old primary during a
#: failover) is given up after this, and a multi-host DSN tries its next host.
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=2)

#: How long a request waits for a connection from the pool before it is answered 503 with
#: Retry-After. A request holds a connection for milliseconds, so a second without one means
#: the pool is exhausted or the database is gone: the client is told to come back at once,
#: instead of holding its connection (and ours) for psycopg_pool's default of 30 seconds.
DEFAULT_POOL_WAIT = timedelta(seconds=1)

#: How long psycopg_pool keeps retrying to replace one lost connection before it gives up (and a
#: request that finds the pool short starts a new try at once). Its default, five minutes, lets
#: the delay between tries double from one second: after a failover the next try came 8.5 to 9.7 s
#: after the new primary accepted writes. Giving up after two seconds keeps the tries at most
#: about a second apart (psycopg_pool's first delay) for as long as requests come.
RECONNECT_TIMEOUT = timedelta(seconds=2)

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def validate_schema(name: str) -> str:
    """``name`` when it may name pgonce's schema, else :class:`ConfigError`: one rule for the
    settings, the CLI and every integration's configuration."""
    if not _SCHEMA_NAME.match(name):
        raise ConfigError(
            f"schema name {name!r} is not allowed: use lower-case letters, digits and underscores, "
            "starting with a letter or underscore, at most 63 characters"
        )
    if name.startswith("pg_") or name == "information_schema":
        # PostgreSQL's own: it refuses to create a pg_ schema (and a pg_temp name would put the
        # tables in each session's temporary schema), while information_schema takes the tables
        # and pg_dump then leaves them out of every backup.
        raise ConfigError(
            f"schema name {name!r} is PostgreSQL's own (pg_ names and information_schema are "
            "reserved for the system): choose another, such as pgonce"
        )
    return name


@refuse_changes
@dataclass(frozen=True, slots=True)
class Settings:
    """Connection and storage settings shared by the library, the CLI and the service."""

    #: libpq connection string or URI; ``None`` starts the embedded PostgreSQL.
    dsn: str | None = None
    schema: str = DEFAULT_SCHEMA
    data_dir: Path = field(default_factory=lambda: DEFAULT_DATA_DIR)
    prepare_threshold: int | None = DEFAULT_PREPARE_THRESHOLD
    pooler: str = DEFAULT_POOLER
    #: A direct connection for LISTEN when ``dsn`` goes through a transaction-mode pooler (where
    #: LISTEN receives nothing); ``None`` listens on ``dsn``.
    listen_dsn: str | None = field(default=None, repr=False)
    #: Refuse to run without a DSN instead of starting the embedded PostgreSQL: set it on every
    #: production host, where a DSN lost to a typo must stop pgonce, not send its writes to a
    #: private database nobody backs up.
    require_dsn: bool = False

    def __post_init__(self) -> None:
        validate_schema(self.schema)
        validate_pooler(self.pooler)

    def connect_kwargs(self) -> dict[str, int | None]:
        """psycopg's connection arguments for these settings: behind a transaction-mode pooler,
        ``prepare_threshold`` is None whatever it was set to."""
        threshold = None if self.pooler == TRANSACTION_POOLER else self.prepare_threshold
        return {"prepare_threshold": threshold}

    def pool_kwargs(
        self,
        *,
        wait: timedelta = DEFAULT_POOL_WAIT,
        connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT,
    ) -> dict[str, Any]:
        """psycopg_pool's arguments for a pool on the request path, with these settings'
        connection arguments: see :func:`pool_kwargs`."""
        return pool_kwargs(self.connect_kwargs(), wait=wait, connect_timeout=connect_timeout)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Read ``PGONCE_DSN``, ``_SCHEMA``, ``_DATA_DIR``, ``_PREPARE_THRESHOLD``, ``_POOLER``,
        ``_LISTEN_DSN`` and ``_REQUIRE_DSN``.

        Keyword arguments that are not ``None`` win over the environment (the command line's
        options are passed this way). ``PGONCE_DSN`` set but empty is an error, not a fallback
        to the embedded server: it is what ``PGONCE_DSN=$DATABASE_URL`` gives when the variable
        it copies is unset.
        """
        env = os.environ if environ is None else environ
        if "PGONCE_DSN" in env and not env["PGONCE_DSN"].strip() and not overrides.get("dsn"):
            raise ConfigError(
                "PGONCE_DSN is set but empty (copied from a variable that is unset?): give it a "
                "connection string, or unset it to use the embedded PostgreSQL"
            )
        settings = cls(
            dsn=env.get("PGONCE_DSN") or None,
            schema=env.get("PGONCE_SCHEMA") or DEFAULT_SCHEMA,
            data_dir=Path(env["PGONCE_DATA_DIR"])
            if env.get("PGONCE_DATA_DIR")
            else DEFAULT_DATA_DIR,
            prepare_threshold=_parse_threshold(env.get("PGONCE_PREPARE_THRESHOLD")),
            pooler=env.get("PGONCE_POOLER") or DEFAULT_POOLER,
            listen_dsn=env.get("PGONCE_LISTEN_DSN") or None,
            require_dsn=_parse_flag("PGONCE_REQUIRE_DSN", env.get("PGONCE_REQUIRE_DSN")),
        )
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(settings, **given) if given else settings  # type: ignore[arg-type]


def own_connect_kwargs(
    given: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """psycopg's arguments for a connection that pgonce opens itself (the inbox worker's, the
    relay's, the receiver's own pool): ``given``, else the environment's settings; behind a
    transaction-mode pooler (``PGONCE_POOLER``) ``prepare_threshold`` is None whatever was given.
    """
    # Only the two variables that decide statement preparation are read: a connection the
    # caller's code names needs no DSN from the environment, so PGONCE_DSN (even set but empty)
    # and PGONCE_REQUIRE_DSN are none of its business.
    env = os.environ if environ is None else environ
    pooler = validate_pooler(env.get("PGONCE_POOLER") or DEFAULT_POOLER)
    if given is None:
        given = {"prepare_threshold": _parse_threshold(env.get("PGONCE_PREPARE_THRESHOLD"))}
    kwargs: dict[str, Any] = dict(given)
    if pooler == TRANSACTION_POOLER:
        kwargs["prepare_threshold"] = None
    return kwargs


def checks_for_pooler(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the pooler is "auto" (``PGONCE_POOLER`` unset): the library checks what its own
    connections reach (:func:`pgonce.database.own_prepare_threshold`)."""
    env = os.environ if environ is None else environ
    return validate_pooler(env.get("PGONCE_POOLER") or DEFAULT_POOLER) == "auto"


def pool_kwargs(
    connect_kwargs: Mapping[str, Any] | None = None,
    *,
    wait: timedelta = DEFAULT_POOL_WAIT,
    connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT,
) -> dict[str, Any]:
    """psycopg_pool's arguments for a pool that serves requests: it fails fast and comes back fast.

    ``AsyncConnectionPool(dsn, min_size=2, max_size=10, **pool_kwargs())``: a request that gets no
    connection within ``wait`` raises ``PoolTimeout`` (the idempotency middleware and the WSGI
    adapter answer it 503 with Retry-After) instead of waiting psycopg_pool's 30 seconds; a
    connect gives a dead host up after ``connect_timeout`` (a multi-host DSN then tries its next
    host); a lost connection is replaced by tries at most about a second apart
    (:data:`RECONNECT_TIMEOUT`), so that after a failover the pool follows the new primary within
    about a second of it accepting writes. ``connect_kwargs`` go to every connection (for
    example :meth:`Settings.connect_kwargs`).
    """
    if wait <= timedelta(0):
        raise ConfigError(f"wait must be longer than 0s, not {wait}")
    if connect_timeout < timedelta(seconds=2) or connect_timeout % timedelta(seconds=1):
        raise ConfigError(
            "connect_timeout must be whole seconds (libpq's unit), at least 2s, "
            f"not {connect_timeout}"
        )
    kwargs = dict(connect_kwargs or {})
    kwargs["connect_timeout"] = int(connect_timeout.total_seconds())
    return {
        "kwargs": kwargs,
        "timeout": wait.total_seconds(),
        "reconnect_timeout": RECONNECT_TIMEOUT.total_seconds(),
    }


def validate_pooler(pooler: str) -> str:
    if pooler not in POOLERS:
        raise ConfigError(f"pooler {pooler!r} is not known: it is one of {', '.join(POOLERS)}")
    return pooler


def _parse_flag(name: str, value: str | None) -> bool:
    if value is None or value.strip().lower() in ("", "0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name} must be 1 or 0 (true or false), not {value!r}")


def _parse_threshold(value: str | None) -> int | None:
    if value is None or value == "":
        return DEFAULT_PREPARE_THRESHOLD
    if value.lower() in ("none", "off"):
        return None
    try:
        threshold = int(value)
    except ValueError:
        raise ConfigError(
            f"PGONCE_PREPARE_THRESHOLD must be a whole number or 'none', not {value!r}"
        ) from None
    if threshold < 0:
        raise ConfigError("PGONCE_PREPARE_THRESHOLD must not be negative")
    return threshold
