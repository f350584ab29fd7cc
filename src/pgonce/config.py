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
#: switches when a prepared statement of its own meets another client's. ``none``: a direct
#: connection, or a pooler that keeps prepared statements per client (PgBouncer >= 1.21 with
#: ``max_prepared_statements``): nothing is checked. ``pgbouncer-transaction``: no prepared
#: statements at all, neither pgonce's nor psycopg's (``prepare_threshold = None``).
POOLERS = ("auto", "none", "pgbouncer-transaction")
DEFAULT_POOLER = "auto"
TRANSACTION_POOLER = "pgbouncer-transaction"

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _validate_schema(name: str) -> str:
    if not _SCHEMA_NAME.match(name):
        raise ConfigError(
            f"schema name {name!r} is not allowed: use lower-case letters, digits and underscores, "
            "starting with a letter or underscore, at most 63 characters"
        )
    return name


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
        _validate_schema(self.schema)
        validate_pooler(self.pooler)

    def connect_kwargs(self) -> dict[str, int | None]:
        """psycopg's connection arguments for these settings: behind a transaction-mode pooler,
        ``prepare_threshold`` is None whatever it was set to."""
        threshold = None if self.pooler == TRANSACTION_POOLER else self.prepare_threshold
        return {"prepare_threshold": threshold}

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
