"""``settings.PGONCE``: the one place the Django integration is configured.

::

    PGONCE = {
        "SCOPE": "payments.scopes.of_request",  # required: whose key a request carries
        "DATABASE": "default",        # the alias whose connection the claim joins
        "SCHEMA": "pgonce",
        "METHODS": ["POST", "PATCH"],
        "ROUTES": {"/webhooks": []},  # path prefix -> methods; [] turns a prefix off
        "REQUIRE_KEY": True,          # 400 for a covered request without a key
        "WAIT": None,                 # seconds a duplicate waits for the original (None: 409 now)
        "RETENTION": 86400,           # seconds advertised in Idempotency-Key-Expires
        "MAX_REQUEST_BYTES": 1048576,
        "MAX_RESPONSE_BYTES": 1048576,
        "CANONICALIZE_JSON": True,
        "STORE_SERVER_ERRORS": False,
        "POOLER": "auto",             # or "none", "pgbouncer-transaction"
    }

``POOLER`` decides whether pgonce prepares its statements on Django's connection. Django turns
psycopg's preparing off by default (``prepare_threshold = None``, for the sake of poolers), which
would make the server parse and plan pgonce's claim and completion on every request. ``"auto"``
asks once per server address in the process (:func:`pgonce.database.reaches_server_directly`),
not once per connection, and prepares them on a connection that reaches PostgreSQL itself;
``"none"`` prepares them always; ``"pgbouncer-transaction"`` never.

Durations are seconds (int or float) or :class:`~datetime.timedelta`. Every problem found is
reported at once, in one :class:`~pgonce.errors.ConfigError`, when the middleware is built (at
Django's start), never at the first request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from inspect import iscoroutinefunction
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from django.utils.module_loading import import_string

from pgonce.config import DEFAULT_POOLER, DEFAULT_SCHEMA, POOLERS, validate_schema
from pgonce.core.frozen import refuse_changes
from pgonce.errors import ConfigError, UsageError
from pgonce.http.semantics import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_METHODS,
    DEFAULT_RETENTION,
    MAX_RETENTION,
    METHOD,
)
from pgonce.store.common import check_wait

#: Names a request's key scope (the caller), or ``None`` to leave the request unprotected.
RequestScope = Callable[[HttpRequest], "str | None"]

_KNOWN = frozenset(
    {
        "SCOPE",
        "DATABASE",
        "SCHEMA",
        "METHODS",
        "ROUTES",
        "REQUIRE_KEY",
        "WAIT",
        "RETENTION",
        "MAX_REQUEST_BYTES",
        "MAX_RESPONSE_BYTES",
        "CANONICALIZE_JSON",
        "STORE_SERVER_ERRORS",
        "POOLER",
    }
)


@refuse_changes
@dataclass(frozen=True, slots=True)
class PgonceSettings:
    scope: RequestScope
    database: str = "default"
    schema: str = DEFAULT_SCHEMA
    methods: Collection[str] = DEFAULT_METHODS
    routes: Mapping[str, Collection[str]] | None = None
    require_key: bool = True
    wait: timedelta | None = None
    retention: timedelta = DEFAULT_RETENTION
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    canonicalize_json: bool = True
    store_server_errors: bool = False
    pooler: str = DEFAULT_POOLER


def _duration(name: str, value: Any, problems: list[str]) -> timedelta | None:
    if isinstance(value, timedelta) and value >= timedelta(0):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf:
        try:
            return timedelta(seconds=value)
        except OverflowError:
            pass
    problems.append(f"PGONCE[{name!r}] must be seconds (a number >= 0) or a timedelta >= 0")
    return None


def _methods(name: str, value: Any, problems: list[str], *, quoted: bool = False) -> frozenset[str]:
    if not isinstance(value, list | tuple | set | frozenset) or not all(
        isinstance(m, str) and METHOD.fullmatch(m) for m in value
    ):
        where = f"'{name}" if quoted else repr(name)  # quoted: ROUTES'][prefix, quoted itself
        problems.append(f"PGONCE[{where}] must be a list of HTTP methods, e.g. ['POST']")
        return frozenset()
    return frozenset(m.upper() for m in value)


def _check_store(raw: Mapping[str, Any], values: dict[str, Any], problems: list[str]) -> None:
    """Check ``DATABASE`` and ``SCHEMA``, the settings every part of the integration reads."""
    if "DATABASE" in raw:
        if not isinstance(raw["DATABASE"], str) or not raw["DATABASE"]:
            problems.append("PGONCE['DATABASE'] must be a non-empty string")
        elif raw["DATABASE"] not in settings.DATABASES:
            problems.append(
                f"PGONCE['DATABASE'] is {raw['DATABASE']!r}, which settings.DATABASES does not "
                f"define (it defines {', '.join(map(repr, settings.DATABASES))})"
            )
        values["database"] = raw["DATABASE"]
    if "SCHEMA" in raw:
        if not isinstance(raw["SCHEMA"], str):
            problems.append("PGONCE['SCHEMA'] must be a string, the name of pgonce's schema")
        else:
            # The core Settings' own check: every entry point accepts the same schema names.
            try:
                values["schema"] = validate_schema(raw["SCHEMA"])
            except ConfigError as error:
                problems.append(f"PGONCE['SCHEMA']: {error}")


#: The last ``(DATABASE, SCHEMA)`` that :func:`store_settings` found valid.
_valid_store: tuple[object, object] | None = None


def store_settings() -> tuple[str, str]:
    """``PGONCE["DATABASE"]`` and ``PGONCE["SCHEMA"]`` (defaults filled in), for the outbox and
    the inbox, which need no ``SCOPE`` and are used without the middleware: checked as
    :func:`load` checks them, once per pair of values, so that a wrong one is a
    :class:`ConfigError` naming it, never a ``TypeError`` from deep inside a write."""
    global _valid_store
    raw = getattr(settings, "PGONCE", None) or {}
    try:
        found = (raw.get("DATABASE", "default"), raw.get("SCHEMA", DEFAULT_SCHEMA))
    except AttributeError:
        found = None
    if found is not None and found == _valid_store:
        return found  # type: ignore[return-value]  # checked: two strings
    if not isinstance(raw, Mapping):
        raise ConfigError("settings.PGONCE must be a dict, e.g. {'SCHEMA': 'pgonce'}")
    problems: list[str] = []
    _check_store(raw, {}, problems)
    if problems:
        raise ConfigError("settings.PGONCE is invalid:\n- " + "\n- ".join(problems))
    _valid_store = found
    return found  # type: ignore[return-value]


def load(raw: Mapping[str, Any] | None = None) -> PgonceSettings:
    """``settings.PGONCE`` (or ``raw``), checked; every problem in one :class:`ConfigError`."""
    if raw is None:
        raw = getattr(settings, "PGONCE", None)
    if not isinstance(raw, Mapping):
        raise ConfigError(
            "settings.PGONCE must be a dict with at least 'SCOPE', the dotted path of a "
            "function of the request that names the caller (see pgonce.contrib.django.scopes)"
        )
    problems: list[str] = []
    unknown = sorted(map(str, set(raw) - _KNOWN))  # a key may be any object
    if unknown:
        problems.append(f"unknown PGONCE settings: {', '.join(unknown)}")
    scope: Any = raw.get("SCOPE")
    if isinstance(scope, str):
        try:
            scope = import_string(scope)
        except ImportError as error:
            problems.append(f"PGONCE['SCOPE'] cannot be imported: {error}")
    if not callable(scope):
        problems.append(
            "PGONCE['SCOPE'] must name a function of the request that returns the caller's "
            "scope (e.g. 'pgonce.contrib.django.scopes.user_scope')"
        )
    elif iscoroutinefunction(scope):
        # Called in the request's transaction thread, never awaited: every covered request
        # would have been a 500 ("the scope must be a str, not coroutine").
        problems.append(
            "PGONCE['SCOPE'] must be a plain function (def), not async def: the middleware "
            "calls it in the request's transaction thread, also under ASGI"
        )
    values: dict[str, Any] = {}
    _check_store(raw, values, problems)
    for name in ("REQUIRE_KEY", "CANONICALIZE_JSON", "STORE_SERVER_ERRORS"):
        if name in raw:
            if not isinstance(raw[name], bool):
                problems.append(f"PGONCE[{name!r}] must be True or False")
            values[name.lower()] = raw[name]
    for name in ("MAX_REQUEST_BYTES", "MAX_RESPONSE_BYTES"):
        if name in raw:
            value = raw[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"PGONCE[{name!r}] must be a positive number of bytes")
            values[name.lower()] = value
    if "METHODS" in raw:
        values["methods"] = _methods("METHODS", raw["METHODS"], problems)
    if "ROUTES" in raw:
        routes = raw["ROUTES"]
        if not isinstance(routes, Mapping):
            problems.append("PGONCE['ROUTES'] must map path prefixes to lists of methods")
        else:
            values["routes"] = {
                str(prefix): _methods(f"ROUTES'][{prefix!r}", methods, problems, quoted=True)
                for prefix, methods in routes.items()
            }
            # Django's request.path_info starts with "/": any other prefix would never match.
            for prefix in routes:
                if not isinstance(prefix, str) or not prefix.startswith("/"):
                    problems.append(
                        f"PGONCE['ROUTES'] prefix {prefix!r} must be a path starting with '/'"
                    )
    if "POOLER" in raw:
        if raw["POOLER"] not in POOLERS:
            problems.append(f"PGONCE['POOLER'] must be one of {', '.join(map(repr, POOLERS))}")
        values["pooler"] = raw["POOLER"]
    if raw.get("WAIT") is not None:
        values["wait"] = wait = _duration("WAIT", raw["WAIT"], problems)
        if wait is not None:
            # The key store's own bounds (PostgreSQL's lock_timeout), listed with the rest.
            try:
                check_wait(wait)
            except UsageError as error:
                problems.append(f"PGONCE['WAIT']: {error}")
    if "RETENTION" in raw:
        values["retention"] = retention = _duration("RETENTION", raw["RETENTION"], problems)
        if retention is not None and retention > MAX_RETENTION:
            # Idempotency-Key-Expires is an HTTP date: one past year 9999 cannot be written,
            # which every answer would find after its transaction committed.
            problems.append("PGONCE['RETENTION'] must be at most 100 years")
    if problems:
        raise ConfigError("settings.PGONCE is invalid:\n- " + "\n- ".join(problems))
    return PgonceSettings(scope=scope, **values)
