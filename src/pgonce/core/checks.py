"""Argument checks for pgonce's public calls: a bad argument is refused at the call, in one line.

A value of the wrong type or shape would otherwise travel to the commit and fail there, far from
the mistake, as a psycopg ``TypeError``. Each check raises :class:`~pgonce.errors.UsageError`
saying what was given, what is expected and how to fix it. No I/O and no psycopg: the expected
connection class is passed in by the store that knows it.
"""

from __future__ import annotations

import inspect
from datetime import datetime, timedelta

from pgonce.errors import UsageError


def describe(value: object) -> str:
    """A value's type for a message: ``a str``, ``None``, ``a psycopg Connection``."""
    if value is None:
        return "None"
    kind = type(value)
    package = kind.__module__.partition(".")[0]
    name = kind.__qualname__ if package in ("builtins", "pgonce") else f"{package} {kind.__name__}"
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _is_async(value: object) -> bool:
    return inspect.iscoroutinefunction(getattr(type(value), "execute", None))


def check_connection(conn: object, expected: type, user: object) -> None:
    """Refuse anything but an instance of ``expected`` (psycopg's sync or async connection class).

    ``user`` is the store (or a name) the message speaks for. A sync connection given to an async
    store, and the reverse, are named as such, with the store to use instead.
    """
    if isinstance(conn, expected):
        return
    name = user if isinstance(user, str) else type(user).__name__
    wants_async = expected.__name__.startswith("Async")
    wanted = f"{'an async' if wants_async else 'a sync'} psycopg connection"
    if hasattr(conn, "pgconn") and _is_async(conn) != wants_async:
        if isinstance(user, str):
            other = f"the {'sync' if wants_async else 'async'} {name}"
        else:
            other = name[len("Async") :] if wants_async else f"Async{name}"
        raise UsageError(
            f"{name} needs {wanted} ({expected.__name__}), and was given "
            f"{'a sync' if wants_async else 'an async'} one: use {other} with it"
        )
    hint = ""
    if type(conn).__name__.endswith("Pool"):
        hint = ": take one from the pool (with pool.connection() as conn: ...)"
    elif type(conn).__name__.endswith("Cursor"):
        hint = ": pass the cursor's connection (cur.connection)"
    elif hasattr(conn, "connection") and not hasattr(conn, "pgconn"):
        hint = ": pass the underlying psycopg 3 connection"
    raise UsageError(f"{name} needs {wanted} ({expected.__name__}), not {describe(conn)}{hint}")


def check_int(value: object, what: str, *, low: int = 1) -> int:
    """Refuse anything but a whole number (not a bool) of at least ``low``."""
    if type(value) is not int or value < low:
        shown = repr(value) if type(value) is int else describe(value)
        raise UsageError(f"{what} must be a whole number of at least {low}, not {shown}")
    return value


def check_bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{what} must be True or False, not {describe(value)}")
    return value


def check_str(value: object, what: str) -> str:
    """Refuse anything but a non-empty str without NUL characters."""
    if not isinstance(value, str):
        raise UsageError(f"{what} must be a str, not {describe(value)}")
    if not value or "\x00" in value:
        raise UsageError(f"{what} must be a non-empty str without NUL characters")
    return value


def storable_text(text: str) -> str:
    """``text`` as a PostgreSQL text column can hold it: an exception's message may carry a NUL
    character or a lone surrogate (from a payload, a peer's answer) that would fail the write
    recording the failure; each becomes ``?``."""
    if "\x00" in text:
        text = text.replace("\x00", "?")
    if not text.isascii():
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def check_instance(value: object, expected: type | tuple[type, ...], what: str, fix: str) -> None:
    """Refuse a value that is not an ``expected``; ``fix`` says where a right one comes from."""
    if not isinstance(value, expected):
        names = " or ".join(
            t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,))
        )
        raise UsageError(f"{what} must be {names}, not {describe(value)}: {fix}")


def check_optional_time(value: object, what: str = "now") -> None:
    """``now`` parameters: None (the database's clock) or an aware datetime."""
    if value is None:
        return
    if not isinstance(value, datetime):
        raise UsageError(f"{what} must be a datetime or None, not {describe(value)}")
    if value.tzinfo is None:
        raise UsageError(
            f"{what} must be timezone-aware (e.g. datetime.now(UTC)): a naive datetime "
            "would be read in the database session's time zone"
        )


def check_duration(value: object, what: str) -> timedelta:
    if not isinstance(value, timedelta):
        raise UsageError(f"{what} must be a datetime.timedelta, not {describe(value)}")
    return value


def check_ids(values: object, what: str) -> list[int]:
    """A sequence of row ids (whole numbers); a lone int or a str is refused, not iterated."""
    if isinstance(values, str | bytes | int) or not hasattr(values, "__iter__"):
        raise UsageError(f"{what} must be a sequence of whole numbers, not {describe(values)}")
    ids = list(values)
    for item in ids:
        if type(item) is not int:
            raise UsageError(f"{what} must hold whole numbers only, not {describe(item)}")
    return ids


def check_strs(values: object, what: str) -> list[str]:
    """A sequence of str; a lone str is refused (it would be read as its characters)."""
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise UsageError(
            f"{what} must be a sequence of str, not {describe(values)}"
            + (f" (for one, pass [{values!r}])" if isinstance(values, str) else "")
        )
    items = list(values)
    for item in items:
        check_str(item, f"each of {what}")
    return items
