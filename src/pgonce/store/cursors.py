"""pgonce's own cursors: its columns are read and written with types it sets, not the connection's.

A connection's adapters belong to its owner. Django registers its own loaders for jsonb and
timestamptz and its own cursor class, an application registers orjson for dict or a loader that
keeps jsonb as text; any of them read through a plain ``conn.cursor()`` would turn a stored
response's headers into a string, or its body into something else, and a replay would no longer
be byte-identical. So the store never runs SQL through ``conn.cursor()`` or ``conn.execute()``:
:func:`cursor` makes a cursor of psycopg's own class whose adapters are a map that pgonce builds
once, from psycopg's defaults, with the standard library's json functions pinned in it (a
global ``set_json_loads()`` or ``set_json_dumps()`` does not reach it either).

The cost is nothing per statement beyond a plain cursor's: the cursor still copies the
connection's map when it is made (psycopg does that for every cursor), and its transformer reads
pgonce's map instead.

JSON is read in the connection's client_encoding, in which PostgreSQL sends json and jsonb (text
and binary alike: binary jsonb is a version byte, then the text), where psycopg's loaders assume
UTF-8. Each loader picks its decoding when the cursor makes it, once per cursor: on a UTF-8
connection it is ``json.loads`` on the bytes, as psycopg's, at the same set-up cost.

Text is read as ``str`` whatever the client_encoding: on ``SQL_ASCII`` (a SQL_ASCII database's
default), where psycopg's text loaders return bytes, it is decoded as UTF-8, the encoding in which
pgonce wrote it (``wire.encoding``'s rule). On any other encoding the loader is psycopg's own,
chosen when the cursor makes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar, overload

from psycopg import (
    AsyncConnection,
    AsyncCursor,
    AsyncRawCursor,
    BaseConnection,
    Connection,
    Cursor,
    RawCursor,
    abc,
    dbapi20,
    postgres,
)
from psycopg._encodings import conn_encoding
from psycopg.abc import AdaptContext
from psycopg.adapt import AdaptersMap, Buffer, Loader
from psycopg.pq import Format
from psycopg.rows import TupleRow, tuple_row
from psycopg.types import array
from psycopg.types.json import (
    JsonbBinaryLoader,
    JsonBinaryLoader,
    JsonbLoader,
    JsonLoader,
    set_json_dumps,
)


def _pinned_adapters() -> AdaptersMap:
    """psycopg's default adapters, built afresh (as ``psycopg/__init__.py`` builds the global map),
    so that nothing registered on the global map or on a connection reaches them."""
    from psycopg._typeinfo import TypesRegistry

    types = TypesRegistry()
    postgres.register_default_types(types)
    adapters = AdaptersMap(types=types)
    postgres.register_default_adapters(adapters)
    dbapi20.register_dbapi20_adapters(adapters)
    array.register_all_arrays(adapters)
    set_json_dumps(json.dumps, adapters)
    for name, loader in _JSON_LOADERS:
        adapters.register_loader(name, loader)
    for text in (_TextLoader, _TextBinaryLoader):
        # psycopg's own text loader (its optimised class where it has one), kept for the
        # connections that are not SQL_ASCII.
        own = adapters.get_loader(25, text.format)
        assert own is not None, "psycopg registers no text loader"
        text._psycopg = own
    for oid in _TEXT_OIDS:
        adapters.register_loader(oid, _TextLoader)
        if oid:  # the unknown oid 0 in binary is bytea's (psycopg's map)
            adapters.register_loader(oid, _TextBinaryLoader)
    return adapters


def _decoding(conn: BaseConnection[Any] | None) -> Callable[[str | bytes], Any]:
    """``json.loads`` for JSON text in the client_encoding of ``conn``.

    ``json.loads`` reads bytes as UTF-8 (or UTF-16/32); so does ``SQL_ASCII``, on which the
    server sends the text as the database holds it (see ``wire.encoding``).
    """
    encoding = conn_encoding(conn)
    if encoding in ("utf-8", "ascii"):
        return json.loads

    def loads(data: str | bytes) -> Any:
        return json.loads(data.decode(encoding) if type(data) is bytes else data)

    return loads


def _init(self: Any, oid: int, context: AdaptContext | None = None) -> None:
    # psycopg's Loader.__init__ and _JsonLoader.__init__ in one, with the decoding decided
    # here: the setting's name first, so that a UTF-8 connection (nearly every one) pays no
    # codec lookup.
    self.oid = oid
    self.connection = conn = context.connection if context is not None else None
    if conn is None or conn.pgconn.parameter_status(b"client_encoding") in _AS_UTF8:
        self.loads = json.loads
    else:
        self.loads = _decoding(conn)


_AS_UTF8 = frozenset((b"UTF8", b"SQL_ASCII", None))


class _JsonLoader(JsonLoader):
    __init__ = _init


class _JsonBinaryLoader(JsonBinaryLoader):
    __init__ = _init


class _JsonbLoader(JsonbLoader):
    __init__ = _init


class _JsonbBinaryLoader(JsonbBinaryLoader):
    __init__ = _init


_JSON_LOADERS = (
    ("json", _JsonLoader),
    ("json", _JsonBinaryLoader),
    ("jsonb", _JsonbLoader),
    ("jsonb", _JsonbBinaryLoader),
)


# The text types psycopg loads as str: the unknown oid, bpchar, name, text, varchar, "char".
_TEXT_OIDS = (0, 1042, 19, 25, 1043, 18)


class _TextLoader(Loader):
    """Text as str: psycopg's own loader (its C one where psycopg has it), or on a ``SQL_ASCII``
    connection, where psycopg's returns bytes, this one, which decodes UTF-8. Decided when the
    cursor makes the loader, once per cursor: each value of any other connection is loaded as by
    psycopg's own map."""

    _psycopg: ClassVar[type[abc.Loader]]

    def __new__(cls, oid: int, context: AdaptContext | None = None) -> abc.Loader:  # type: ignore[misc]
        # No super(): about a microsecond more than psycopg's own loader costs to make, once
        # per cursor that reads text.
        if (
            context is not None
            and (conn := context.connection) is not None
            and conn.pgconn.parameter_status(b"client_encoding") == b"SQL_ASCII"
        ):
            return object.__new__(cls)  # then Loader.__init__
        return cls._psycopg(oid, context)

    def load(self, data: Buffer) -> str:
        return str(data, "utf-8")


class _TextBinaryLoader(_TextLoader):
    format = Format.BINARY


#: The adapters of every statement the store runs.
ADAPTERS = _pinned_adapters()


class _Pinned:
    """Adapts with :data:`ADAPTERS` whatever the connection's adapters are (psycopg's cursor
    builds its transformer from this property)."""

    __slots__ = ()

    @property
    def adapters(self) -> AdaptersMap:
        return ADAPTERS


class _AsyncCursor(_Pinned, AsyncCursor[TupleRow]):
    __slots__ = ()


class _Cursor(_Pinned, Cursor[TupleRow]):
    __slots__ = ()


class _AsyncRawCursor(_Pinned, AsyncRawCursor[TupleRow]):
    __slots__ = ()


class _RawCursor(_Pinned, RawCursor[TupleRow]):
    __slots__ = ()


@overload
def cursor(conn: AsyncConnection[Any]) -> AsyncCursor[TupleRow]: ...
@overload
def cursor(conn: Connection[Any]) -> Cursor[TupleRow]: ...
def cursor(
    conn: AsyncConnection[Any] | Connection[Any],
) -> AsyncCursor[TupleRow] | Cursor[TupleRow]:
    """A cursor on ``conn`` that returns tuples and adapts with pgonce's :data:`ADAPTERS`.

    Whatever the connection's ``cursor_factory``, ``row_factory`` and adapters are.
    """
    if isinstance(conn, AsyncConnection):
        return _AsyncCursor(conn, row_factory=tuple_row)
    return _Cursor(conn, row_factory=tuple_row)


@overload
def raw_cursor(conn: AsyncConnection[Any]) -> AsyncRawCursor[TupleRow]: ...
@overload
def raw_cursor(conn: Connection[Any]) -> RawCursor[TupleRow]: ...
def raw_cursor(
    conn: AsyncConnection[Any] | Connection[Any],
) -> AsyncRawCursor[TupleRow] | RawCursor[TupleRow]:
    """:func:`cursor` for a statement with PostgreSQL's own ``$n`` placeholders.

    psycopg sends the statement as it is and dumps the parameters in order: no conversion of
    ``%(name)s`` placeholders and no reordering of a mapping, which psycopg does at every
    execution (for the outbox's enqueue, eight parameters, a measurable share of the business
    transaction's client work: ``python -m bench.client_instructions DSN --only outbox``).
    psycopg still prepares the statement (after ``prepare_threshold`` executions) and keeps its
    prepared statements as for any other.
    """
    if isinstance(conn, AsyncConnection):
        return _AsyncRawCursor(conn, row_factory=tuple_row)
    return _RawCursor(conn, row_factory=tuple_row)
