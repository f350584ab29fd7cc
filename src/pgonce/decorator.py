"""``@idempotent``: a function or message handler that runs once per key, its result replayed.

::

    @idempotent(key="order_id")
    def charge(conn: psycopg.Connection, order_id: str, amount: int) -> dict[str, int]:
        conn.execute("INSERT INTO charges (order_id, amount) VALUES (%s, %s)", (order_id, amount))
        return {"amount": amount}

    with pool.connection() as conn:        # the pool commits when the block ends
        charge(conn, "order-42", 1000)     # runs: the charge, the claim and the result commit
    with pool.connection() as conn:
        charge(conn, "order-42", 1000)     # a replay: the stored result, nothing ran

The call is the key store's :meth:`~pgonce.KeyStore.once` block around the function, so it has
the key store's semantics and nothing of its own:

- **the key** is ``key``: the name of an argument (its value is the key: a str as it is, an int
  or a UUID as text, anything else as the SHA-256 of its canonical JSON, as Powertools hashes its
  payload; None is refused, since every call without a key would share one), or a function
  called with the decorated function's arguments. The claims' scope is
  ``scope`` (default: the function's module and qualified name; set it to keep the keys valid
  across a rename).
- **the connection** is the argument named ``connection`` (``"conn"`` by default): a psycopg
  ``Connection`` for a plain function, an ``AsyncConnection`` for a coroutine function. The
  function writes on it, and its writes, the claim and the stored result commit together. By
  default the call joins the caller's transaction (a savepoint in it; the caller commits, e.g. the
  end of ``pool.connection()``); with ``commit=True`` the call owns a transaction of its own on an
  idle connection and has committed when it returns (what a message handler needs before it
  acknowledges); the function's own ``conn.commit()`` or ``conn.rollback()`` there raises
  :class:`~pgonce.UsageError`, and nothing commits.
- **the result** is stored with ``codec`` (JSON by default: tuples come back as lists, dict keys
  as str, an IntEnum as its int; a dataclass needs a codec of its own) and a replay returns the
  stored result, decoded, without calling the function. The first call returns that same
  decoded result, not the function's own object: what a caller gets never depends on whether the
  call ran or replayed. A result the codec cannot encode raises :class:`~pgonce.UsageError`, and
  nothing commits; so does a coroutine or a generator returned unrun (an async function behind
  a plain wrapper: put ``@idempotent`` right above the ``async def``).
- **mismatch**: the same key with other arguments (``payload``: by default every argument but the
  connection, as canonical JSON; or an argument's name, or a function of the arguments) raises
  :class:`~pgonce.KeyMismatch`; never a silent replay.
- **in flight**: another call holds the key (it has not committed yet) and ``wait`` ran out:
  :class:`~pgonce.errors.KeyInFlight`, with ``retry_after``. Nothing ran.
- **rollback**: the function raises, and its writes and the claim roll back (the savepoint, or
  the owned transaction): the key is free and a retry runs the function again.

Message handlers: decorate the broker callback with ``commit=True`` and acknowledge when it
returns, requeue on :class:`~pgonce.errors.KeyInFlight`, and let the broker redeliver on any other
exception; or run the decorated function inside :meth:`pgonce.consumers.IdempotentConsumer.handle`,
where it joins the consumer's transaction.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import functools
import hashlib
import inspect
import json
import uuid
from collections.abc import Callable, Coroutine, Mapping
from datetime import timedelta
from decimal import Decimal
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, overload

import psycopg

from pgonce.core.fingerprint import fingerprint_of
from pgonce.core.outcomes import (
    MAX_KEY_BYTES,
    Claim,
    InFlight,
    Replay,
    Response,
    _checked_response,
    validate_key,
)
from pgonce.errors import KeyInFlight, UsageError
from pgonce.store._async.keys import AsyncKeyStore
from pgonce.store._async.keys import rollback_quietly as async_rollback_quietly
from pgonce.store._sync.keys import KeyStore, rollback_quietly
from pgonce.store.common import check_wait, hold
from pgonce.store.wire import headers_json, json_value

__all__ = ["Codec", "JSONCodec", "idempotent"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

#: An argument's name, or a function of the decorated function's arguments.
ArgumentSource = str | Callable[..., object]


class Codec(Protocol[T]):
    """How a result is stored and read back; ``content_type`` is stored with it."""

    content_type: str

    def encode(self, value: T, /) -> bytes: ...

    def decode(self, data: bytes, /) -> T: ...


def _encoder(options: json.JSONEncoder) -> Callable[[Any], str]:
    """``options.encode``, with json's C encoder made once rather than at every call.

    Every call of a decorated function encodes its arguments and its result, and
    ``JSONEncoder.encode`` makes a new C encoder each time (its options, its set of containers
    seen): for the small values of a call, that cost more than the encoding itself (4.3 µs
    against 1.5 for a result of three keys). Made once, it keeps no such set, which a call in
    another thread would share: a value that contains itself fails with :class:`RecursionError`
    rather than json's ``ValueError``, and the callers refuse both alike. Where json has no C
    encoder, ``options.encode`` as it is.
    """
    make: Callable[..., Callable[[Any, int], list[str]]] | None = getattr(
        json.encoder, "c_make_encoder", None
    )  # not in the type stubs
    if make is None or options.indent is not None:
        return options.encode
    chunks = make(
        None,
        options.default,
        json.encoder.encode_basestring_ascii
        if options.ensure_ascii
        else json.encoder.encode_basestring,
        options.indent,
        options.key_separator,
        options.item_separator,
        options.sort_keys,
        options.skipkeys,
        options.allow_nan,
    )
    join = "".join

    def encode(value: Any) -> str:
        return join(chunks(value, 0))

    return encode


#: The encoders, made once (see _encoder): ``json.dumps`` with any option makes a new one at
#: every call too.
_RESULT = _encoder(json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")))


class JSONCodec:
    """Results as JSON (the default): what ``json.dumps`` takes, NaN and infinities refused."""

    content_type = "application/json"

    def encode(self, value: Any, /) -> bytes:
        try:
            text = _RESULT(value)
        except (TypeError, ValueError, RecursionError) as error:
            _refuse_unrun(value)
            raise UsageError(
                f"the result cannot be stored as JSON ({error}); return JSON data, or give "
                "@idempotent a codec= that encodes and decodes this type"
            ) from None
        return text.encode("utf-8", "surrogatepass")

    def decode(self, data: bytes, /) -> Any:
        # json.loads() as the key store parses its stored headers: straight to the json module's
        # C scanner, json.loads() itself for anything the scanner does not take whole.
        return json_value(data.decode("utf-8", "surrogatepass"))


_JSON = JSONCodec()


def _refuse_unrun(value: object) -> None:
    """Refuse a result that is work not done yet: a coroutine or a generator, whose body would
    run (if ever) after the call returned, outside the claim. Closed, so that it never runs."""
    if inspect.iscoroutine(value) or inspect.isgenerator(value):
        value.close()
        kind = "a coroutine" if inspect.iscoroutine(value) else "a generator"
        raise UsageError(
            f"the decorated function returned {kind}, which has not run: nothing was done and "
            "nothing was stored. A coroutine comes from an async function behind a plain "
            "wrapper (put @idempotent right above the async def, where it awaits it); a "
            "generator from a generator: return the values (a list) instead"
        )


def _plain(value: object) -> object:
    """A JSON shape for the argument types that have one obvious; anything else is refused."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, uuid.UUID | Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return sorted(value, key=_canonical)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    dump = getattr(value, "model_dump", None)  # a pydantic model
    if callable(dump):
        return dump(mode="json")
    raise TypeError(f"{type(value).__name__} has no canonical JSON form")


_canonical = _encoder(
    json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain)
)


def _canonical_bytes(value: object, what: str) -> bytes:
    try:
        return _canonical(value).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError) as error:
        raise UsageError(
            f"{what} cannot be fingerprinted ({error}): name an argument that can as "
            "@idempotent(payload=...), or give a function that returns what makes two calls the "
            "same"
        ) from None


def _key_text(value: object) -> str:
    if value is None:
        # Hashed like any value, every call without a key would share one: the second such call
        # with the same arguments would replay the first, a distinct operation silently dropped.
        raise UsageError(
            "the key's value is None: a call without a key cannot be told from another; give "
            "every call a key of its own"
        )
    if isinstance(value, str):
        return value
    if isinstance(value, int | uuid.UUID) and not isinstance(value, bool):
        try:
            return str(value)
        except ValueError:  # more digits than Python writes out (sys.get_int_max_str_digits())
            raise UsageError(
                "the key's value is an int too long to be a key: a key is at most "
                f"{MAX_KEY_BYTES} bytes"
            ) from None
    return "sha256:" + hashlib.sha256(_canonical_bytes(value, "the key's value")).hexdigest()


class _Arguments:
    """Reads the decorated function's arguments by name without binding the whole signature."""

    __slots__ = ("default", "index", "name")

    def __init__(self, signature: inspect.Signature, name: str, role: str) -> None:
        parameter = signature.parameters.get(name)
        if parameter is None or parameter.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            raise UsageError(
                f"@idempotent({role}={name!r}) names no parameter of the function; its "
                f"parameters are: {', '.join(signature.parameters) or 'none'}"
            )
        self.name = name
        positional = list(signature.parameters).index(name)
        self.index = positional if parameter.kind != inspect.Parameter.KEYWORD_ONLY else None
        self.default = parameter.default

    def of(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        if self.name in kwargs:
            return kwargs[self.name]
        if self.index is not None and self.index < len(args):
            return args[self.index]
        if self.default is inspect.Parameter.empty:
            raise TypeError(f"missing the argument {self.name!r}")
        return self.default


class Idempotent:
    """The decorator :func:`idempotent` returns; apply it to a function or a coroutine function."""

    def __init__(
        self,
        *,
        key: ArgumentSource,
        connection: str,
        scope: str | None,
        payload: ArgumentSource | None,
        codec: Codec[Any] | None,
        commit: bool,
        store: KeyStore | AsyncKeyStore | None,
        wait: timedelta | None,
    ) -> None:
        if not (isinstance(key, str) and key) and not callable(key):
            raise UsageError("key must name an argument, or be a function of the arguments")
        if (
            payload is not None
            and not (isinstance(payload, str) and payload)
            and not (callable(payload))
        ):
            raise UsageError("payload must name an argument, or be a function of the arguments")
        if not isinstance(connection, str) or not connection:
            raise UsageError("connection must name the argument that carries the connection")
        if scope is not None and (not isinstance(scope, str) or not scope):
            raise UsageError("scope must be a non-empty str")
        if codec is not None and not (
            callable(getattr(codec, "encode", None)) and callable(getattr(codec, "decode", None))
        ):
            raise UsageError("codec must have encode(value) -> bytes and decode(bytes) -> value")
        content_type = getattr(codec, "content_type", "")
        if not isinstance(content_type, str) or any(
            ord(c) < 0x20 or ord(c) == 0x7F for c in content_type
        ):
            # Stored with every result: a NUL failed the completion at the first call (after the
            # function ran), a line break would end a header wherever the result is shown.
            raise UsageError(
                f"codec.content_type must be a str without control characters, not {content_type!r}"
            )
        if not isinstance(commit, bool):
            raise UsageError("commit must be True or False")
        if store is not None and not isinstance(store, KeyStore | AsyncKeyStore):
            raise UsageError(f"store must be a pgonce KeyStore, not {type(store).__name__}")
        if scope is not None:
            validate_key(scope, "-")  # a scope the key store would refuse at every call
            if not scope.isascii():
                _check_sendable(scope)
        if wait is not None:
            check_wait(wait)  # as the key store checks it at every call: here once, at import
        self.key = key
        self.connection = connection
        self.scope = scope
        self.payload = payload
        self.codec: Codec[Any] = codec or _JSON
        self.commit = commit
        self.store = store
        self.wait = wait

    @overload
    def __call__(
        self, function: Callable[P, Coroutine[Any, Any, R]], /
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, function: Callable[P, R], /) -> Callable[P, R]: ...

    def __call__(self, function: Callable[P, Any], /) -> Callable[P, Any]:
        if isinstance(function, staticmethod | classmethod):
            raise UsageError(
                "@idempotent decorates the function itself: write it below @staticmethod or "
                "@classmethod, not above"
            )
        if not callable(function):
            raise UsageError("@idempotent decorates a function")
        if inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
            # Its body runs as its values are read, after the call returned and committed: the
            # side effects would not be inside the claim, nor the values in the stored result.
            raise UsageError(
                "@idempotent cannot decorate a generator function: its body runs after the call "
                "returned, outside the claim; decorate a function that returns the values (a list)"
            )
        call = _Call(self, function)
        if call.is_async:
            run_async = call.run_async

            @functools.wraps(function)
            async def called_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                return await run_async(args, kwargs)

            return called_async
        run = call.run

        @functools.wraps(function)
        def called(*args: P.args, **kwargs: P.kwargs) -> Any:
            return run(args, kwargs)

        return called


class _Call(Generic[P]):
    """The decorated function with everything about its arguments worked out once."""

    def __init__(self, options: Idempotent, function: Callable[P, Any]) -> None:
        self.function = function
        self.is_async = is_async = _is_coroutine_function(function)
        store = options.store
        if store is None:
            store = AsyncKeyStore() if is_async else KeyStore()
        elif is_async != isinstance(store, AsyncKeyStore):
            wanted = "an AsyncKeyStore" if is_async else "a KeyStore (the sync one)"
            kind = "coroutine function" if is_async else "function"
            raise UsageError(f"a {kind} needs {wanted}, not {type(store).__name__}")
        self.store = store
        self.options = options
        self.signature = signature = inspect.signature(function)
        self.scope = options.scope or _default_scope(function)
        validate_key(self.scope, "-")
        self.conn = _Arguments(signature, options.connection, "connection")
        self.key = (
            _Arguments(signature, options.key, "key") if isinstance(options.key, str) else None
        )
        self.payload = (
            _Arguments(signature, options.payload, "payload")
            if isinstance(options.payload, str)
            else None
        )
        self.headers = (("content-type", str(getattr(options.codec, "content_type", ""))),)
        self.headers_json = headers_json(self.headers)  # as a completion stores them
        parameters = signature.parameters.values()
        kinds = inspect.Parameter
        self.plain = all(
            p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD) for p in parameters
        )
        self.positional = [
            p.name
            for p in parameters
            if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        ]
        self.keywords = frozenset(p.name for p in parameters if p.kind != kinds.POSITIONAL_ONLY)
        self.defaults = {p.name: p.default for p in parameters if p.default is not kinds.empty}
        self.required = frozenset(p.name for p in parameters if p.default is kinds.empty)
        #: Every parameter can be given by position: a call that gives them all so, and no
        #: keyword, names each one exactly once.
        self.all_positional = self.plain and len(self.positional) == len(signature.parameters)
        #: How many arguments a call that gives every parameter by position has (-1 where
        #: not every parameter can be given so): such a call has each argument at its
        #: parameter's index.
        self.by_position = len(self.positional) if self.all_positional else -1
        self.conn_index = self.conn.index
        #: The payload's arguments of such a call: (name, index), in the signature's order.
        self.others = tuple(
            (name, index)
            for index, name in enumerate(self.positional)
            if name != options.connection
        )
        self.key_function = None if isinstance(options.key, str) else options.key
        first = next(iter(signature.parameters), None)
        #: What a payload that cannot be fingerprinted is called in the error: a method's
        #: default payload holds its instance, which the message names.
        self.arguments_are = (
            f"the call's arguments ({first} among them: a method's default payload holds its "
            f"{'class' if first == 'cls' else 'instance'})"
            if options.payload is None and first in ("self", "cls")
            else "the call's arguments"
        )
        self.payload_function = None if isinstance(options.payload, str) else options.payload

    def claim(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str, bytes]:
        """The call's connection, key and fingerprint."""
        positional = not kwargs and len(args) == self.by_position
        conn = args[self.conn_index] if positional else self.conn.of(args, kwargs)  # type: ignore[index]
        if self.key is not None:
            value = self.key.of(args, kwargs)
        else:
            value = self.key_function(*args, **kwargs)  # type: ignore[misc]
        key = value if type(value) is str else _key_text(value)
        if self.payload is not None:
            payload = self.payload.of(args, kwargs)
        elif self.payload_function is not None:
            payload = self.payload_function(*args, **kwargs)
        elif positional:
            # Every argument given by position (the usual call): nothing to merge or check.
            payload = {}
            for name, index in self.others:
                payload[name] = args[index]
        else:
            payload = self.arguments(args, kwargs)
        return conn, key, fingerprint_of(_canonical_bytes(payload, self.arguments_are))

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every argument by name, defaults included, but the connection, for a call that does
        not give every parameter by position (:meth:`claim` reads those itself).

        Without binding the signature when the call is plain (no ``*args``/``**kwargs`` in the
        signature, every name known, none given twice): binding costs more than the rest of the
        fingerprint. Any other call is bound, which raises the TypeError the function would.
        """
        names = self.positional
        if self.plain and len(args) <= len(names):
            given = dict(zip(names, args, strict=False))
            keywords = kwargs.keys()
            if keywords <= self.keywords and not keywords & given.keys():
                given.update(kwargs)
                if self.required <= given.keys():
                    payload = {**self.defaults, **given}
                    del payload[self.conn.name]
                    return payload
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return {n: v for n, v in bound.arguments.items() if n != self.conn.name}

    def _stored(self, result: object) -> Response:
        body = self.options.codec.encode(result)
        if type(body) is not bytes:
            body = _codec_bytes(body)
        # The headers were checked once: only the body is new.
        return _checked_response(None, self.headers, body)

    def _returned(self, body: bytes) -> Any:
        """What the first call returns: the stored result as every replay will decode it.

        Not the function's own object: a tuple stored as JSON replays as a list, a dict's int keys
        as str, and a caller that got one type from the call that ran and another from a replay
        would see the same operation answer differently. Decoded before the claim commits, so a
        codec that cannot read back what it wrote fails with nothing stored.
        """
        return self.options.codec.decode(body)

    def _body(self, result: object) -> bytes:
        """The stored body of ``result``: what :meth:`_stored` would hold, without the Response."""
        body = self.options.codec.encode(result)
        return body if type(body) is bytes else _codec_bytes(body)

    def _replayed(self, claim: Claim, key: str) -> Any:
        if isinstance(claim, InFlight):
            raise KeyInFlight(self.scope, key, claim.retry_after, claim.reason)
        assert isinstance(claim, Replay)
        return self.options.codec.decode(claim.response.body)

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The wrapper's arguments as they came, not unpacked and packed again for this call.
        conn, key, fp = self.claim(args, kwargs)
        store = self.store
        assert isinstance(store, KeyStore)
        options = self.options
        if options.commit:
            # once(commit=True)'s block, written out: begin(), the function, commit(), without
            # the block's object and its checks of what this call made itself, nor a Won and a
            # Response made only to be read back by commit().
            scope = self.scope
            wait_ms = store._checked_wait_ms(conn, scope, key, fp, options.wait)
            claimed = store._begin(conn, scope, key, fp, wait_ms, None, _OWNED_REFUSAL)
            if not isinstance(claimed, tuple):
                store._commit(conn, claimed, None, (), None)  # begin() ended it: nothing is sent
                return self._replayed(claimed, key)
            hold(conn, 1)  # the function cannot end the claim's transaction (see hold())
            try:
                result = self.function(*args, **kwargs)
                body = self._body(result)
                returned = self._returned(body)
            except BaseException as error:
                hold(conn, -1)
                rollback_quietly(conn)
                _refuse_ended(error)
                raise
            hold(conn, -1)
            store._complete_owned(conn, claimed, self.headers_json, body)
            return returned
        with store.once(conn, self.scope, key, fp, wait=options.wait) as op:
            if op.won:
                result = self.function(*args, **kwargs)
                stored = self._stored(result)
                returned = self._returned(stored.body)
                op.respond(stored)
                return returned
        return self._replayed(op.claim, key)

    async def run_async(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        conn, key, fp = self.claim(args, kwargs)
        store = self.store
        assert isinstance(store, AsyncKeyStore)
        options = self.options
        if options.commit:  # as in run()
            scope = self.scope
            wait_ms = store._checked_wait_ms(conn, scope, key, fp, options.wait)
            claimed = await store._begin(conn, scope, key, fp, wait_ms, None, _OWNED_REFUSAL)
            if not isinstance(claimed, tuple):
                await store._commit(conn, claimed, None, (), None)
                return self._replayed(claimed, key)
            hold(conn, 1)
            try:
                result = await self.function(*args, **kwargs)
                body = self._body(result)
                returned = self._returned(body)
            except BaseException as error:
                hold(conn, -1)
                await async_rollback_quietly(conn)
                _refuse_ended(error)
                raise
            hold(conn, -1)
            await store._complete_owned(conn, claimed, self.headers_json, body)
            return returned
        async with store.once(conn, self.scope, key, fp, wait=options.wait) as op:
            if op.won:
                result = await self.function(*args, **kwargs)
                stored = self._stored(result)
                returned = self._returned(stored.body)
                op.respond(stored)
                return returned
        return self._replayed(op.claim, key)


def _codec_bytes(body: object) -> bytes:
    """What the codec's ``encode()`` returned, as the stored body: bytes-like as bytes, anything
    else refused in the codec's words (a Response's own refusal spoke of a Response the caller
    never built, and told it to set a Content-Type header)."""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    raise UsageError(
        f"the codec's encode() returned {type(body).__name__}, not bytes: nothing was stored; "
        "a codec's encode() returns the bytes to store (text.encode('utf-8'), say)"
    )


def _refuse_ended(error: BaseException) -> None:
    """Say what psycopg's refusal of a ``commit()`` or ``rollback()`` inside a ``commit=True``
    call means: the transaction is the call's (see hold()), not a block the function can see."""
    if isinstance(error, psycopg.ProgrammingError) and "forbidden within a Transaction" in str(
        error
    ):
        raise UsageError(
            "the function decorated with @idempotent(commit=True) called conn.commit() or "
            "conn.rollback(): the call owns the transaction and commits it with the stored "
            "result when the function returns; nothing was done. Raise to undo it all, or "
            "undo a part with a savepoint (with conn.transaction(): ...)"
        ) from error


def _is_coroutine_function(function: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one (the run must await it)."""
    call = type(function).__call__
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


def _check_sendable(scope: str) -> None:
    """Refuse a scope with a lone surrogate: no connection's encoding carries one, and every
    call would fail."""
    try:
        scope.encode()
    except UnicodeEncodeError as error:
        raise UsageError(
            f"scope holds a lone surrogate at position {error.start}, which no connection can "
            "send: give a scope of Unicode text"
        ) from None


def _default_scope(function: Callable[..., Any]) -> str:
    """The function's module and qualified name; refused where it has none to give."""
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(name, str):
        raise UsageError(
            f"@idempotent found no name for {type(function).__name__} {function!r} to make the "
            "claims' scope from: give it scope=..."
        )
    if "<lambda>" in name:
        # Every lambda of a module has this name: two would share their claims, and one
        # would replay the other's result for the same key and arguments.
        raise UsageError(
            f"@idempotent cannot make the claims' scope of a lambda from its name ({name}), "
            "which every lambda of its module shares: give it scope=..."
        )
    return f"{module}.{name}"


#: What a connection inside a transaction is told by a function decorated with ``commit=True``.
_OWNED_REFUSAL = (
    "@idempotent(commit=True) commits a transaction of its own and needs an idle connection, "
    "outside a transaction and outside conn.pipeline(); inside the caller's transaction, "
    "decorate the function without commit=True"
)


def idempotent(
    *,
    key: ArgumentSource,
    connection: str = "conn",
    scope: str | None = None,
    payload: ArgumentSource | None = None,
    codec: Codec[Any] | None = None,
    commit: bool = False,
    store: KeyStore | AsyncKeyStore | None = None,
    wait: timedelta | None = None,
) -> Idempotent:
    """Make a function (or coroutine function) run once per key; see the module's docstring.

    Everything is checked here, when the function is decorated (a ``key``, ``payload`` or
    ``connection`` that names no parameter, a store of the wrong kind): a
    :class:`~pgonce.UsageError` at import time, never at the first call. The decorated function
    keeps its signature for type checkers (``ParamSpec``).
    """
    return Idempotent(
        key=key,
        connection=connection,
        scope=scope,
        payload=payload,
        codec=codec,
        commit=commit,
        store=store,
        wait=wait,
    )
