"""What a claim can end in, and the pure decision that maps a stored row to an outcome.

A claim has three expected outcomes, each a value: :class:`Won` (do the work), :class:`Replay` (a
stored response) and :class:`InFlight` (the original is still running, or cannot be seen yet). The
fourth, a mismatch (same key, another request), is an error: :class:`~pgonce.errors.KeyMismatch`.
"""

from __future__ import annotations

import hmac
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pgonce.core.fingerprint import FINGERPRINT_SIZE
from pgonce.core.frozen import refuse_changes
from pgonce.errors import KeyMismatch, UsageError

#: Longest scope or key, in UTF-8 bytes (the table's CHECK constraints say the same).
MAX_KEY_BYTES = 512

Header = tuple[str, str]

#: 429 Too Many Requests: a refusal before the work (a rate limit, a provider's "not now"),
#: never stored for replay, whatever else is kept: the retry after Retry-After must run.
TOO_MANY_REQUESTS = 429


@refuse_changes
@dataclass(frozen=True, slots=True, init=False)
class Response:
    """What the caller answered, stored at completion and replayed verbatim.

    ``status`` is an HTTP status for HTTP callers and any integer (or ``None``) for others.
    ``headers`` keep their order and repeated names: a sequence of ``(name, value)`` pairs of
    str (a mapping is accepted and taken as its items). ``body`` is bytes. Anything else is
    refused here with :class:`~pgonce.errors.UsageError`, not at the commit.
    """

    status: int | None = None
    headers: tuple[Header, ...] = ()
    body: bytes = b""

    def __init__(
        self, status: int | None = None, headers: tuple[Header, ...] = (), body: bytes = b""
    ) -> None:
        # Checked here, not at the commit, where a wrong type would surface as psycopg's error far
        # from the mistake. Shapes that mean the same are normalised so that equality holds.
        # The dataclass's own __init__ would set each field through object.__setattr__ (it is
        # frozen) and then call __post_init__: this one sets the slots directly, for a third of
        # the cost of every response an application makes.
        if status is not None and (
            type(status) is not int or not _MIN_STATUS <= status <= _MAX_STATUS
        ):
            _check_status(status)
        if type(body) is not bytes:
            body = _body(body)
        # The headers that passed last are the same object again when the application answers
        # with a constant (a tuple of str tuples cannot change): not walked again.
        plain = headers is _last_plain[0] or (type(headers) is tuple and _new_pairs(headers))
        if plain:
            _last_plain[0] = headers
        _response_status(self, status)
        _response_headers(self, headers if plain else _headers(headers))
        _response_body(self, body)

    @classmethod
    def from_stored(
        cls, status: int | None, headers: Sequence[Sequence[str]] | None, body: bytes | None
    ) -> Response:
        body = body if type(body) is bytes else bytes(body or b"")
        if (
            type(headers) is tuple
            and cls is Response
            and (status is None or type(status) is int)
            and _str_pairs(headers)
        ):
            # The key store's replays: its pairs are (name, value) tuples of str already (checked
            # all the same, for a tuple from anywhere else).
            return _checked_response(status, headers, body)
        pairs = []
        # A plain loop (this runs for every replay): the pairs as stored, [name, value] lists
        # of str, become tuples as they are; anything else is made str, as it always was.
        for pair in headers or ():
            if type(pair) is list and len(pair) == 2:
                name, value = pair
                if type(name) is str and type(value) is str:
                    pairs.append((name, value))
                    continue
            name, value = pair
            pairs.append((str(name), str(value)))
        if cls is Response and (status is None or type(status) is int):
            return _checked_response(status, tuple(pairs), body)
        return cls(status, tuple(pairs), body)


#: The headers of the last new Response that held them as given (see Response.__init__).
_last_plain: list[Any] = [()]

#: The stored status is an ``integer`` column.
_MIN_STATUS = -(2**31)
_MAX_STATUS = 2**31 - 1


def _check_status(status: object) -> None:
    if type(status) is not int:
        raise UsageError(f"Response status must be an int or None, not {type(status).__name__}")
    raise UsageError(
        f"Response status must fit in 32 bits (an HTTP status is 100 to 599), not {status}"
    )


def _body(body: object) -> bytes:
    if isinstance(body, bytearray | memoryview):
        return bytes(body)
    if isinstance(body, str):
        raise UsageError(
            "Response body must be bytes, not str: encode it (body=text.encode()) "
            "and say which encoding in a Content-Type header"
        )
    raise UsageError(f"Response body must be bytes, not {type(body).__name__}")


def _str_pairs(headers: tuple[Any, ...]) -> bool:
    """Whether every member is a ``(str, str)`` tuple of ASCII text: headers a Response holds as
    they are (anything else goes through :func:`_headers`, which checks it).

    A plain loop: this runs for every stored and every replayed response, and a generator costs
    more.
    """
    for pair in headers:
        if type(pair) is not tuple or len(pair) != 2:
            return False
        name, value = pair
        if type(name) is not str or type(value) is not str:
            return False
        if not (name.isascii() and value.isascii()):
            return False  # _headers() checks that it is text UTF-8 can carry
    return True


def _new_pairs(headers: tuple[Any, ...]) -> bool:
    """:func:`_str_pairs` for a new Response's headers, which may hold a NUL too: PostgreSQL's
    jsonb cannot store U+0000, and the completion would fail after the work ran. (A replay's
    headers come from jsonb, and hold none.)"""
    for pair in headers:
        if type(pair) is not tuple or len(pair) != 2:
            return False
        name, value = pair
        if type(name) is not str or type(value) is not str:
            return False
        if not (name.isascii() and value.isascii()) or "\x00" in name or "\x00" in value:
            return False  # _headers() checks it
    return True


def new_response(status: int | None, pairs: list[Header], body: bytes) -> Response:
    """``Response(status, tuple(pairs), body)`` for the pairs an adapter has just made (a list
    of new 2-tuples, as :func:`pgonce.http.replay.storable_pairs` makes them): every name and
    value is checked at once, joined in C, rather than pair by pair in :func:`_new_pairs`.
    Anything that fails a quick check goes through ``Response()`` itself, which accepts or
    refuses it as it always did."""
    headers = tuple(pairs)
    try:
        joined = "".join(_members(headers))
    except TypeError:  # not all text: Response() says what it makes of them
        return Response(status, headers, body)
    if (
        joined.isascii()
        and "\x00" not in joined
        and type(body) is bytes
        and (status is None or (type(status) is int and _MIN_STATUS <= status <= _MAX_STATUS))
    ):
        made = _new(_ResponseFields)  # _checked_response(), written out
        made.status = status
        made.headers = headers
        made.body = body
        made.__class__ = Response
        return made  # type: ignore[no-any-return]
    return Response(status, headers, body)


_members = itertools.chain.from_iterable


def _headers(headers: object) -> tuple[Header, ...]:
    """Headers as a tuple of (name, value) str pairs; a mapping is taken as its items."""
    if isinstance(headers, Mapping):
        headers = list(headers.items())
    if isinstance(headers, str | bytes) or not isinstance(headers, Iterable):
        raise UsageError(
            "Response headers must be a sequence of (name, value) pairs of str, not "
            f"{type(headers).__name__}"
        )
    pairs = []
    for header in headers:
        if (
            not isinstance(header, tuple | list)
            or len(header) != 2
            or not all(isinstance(part, str) for part in header)
        ):
            raise UsageError(
                "Response headers must be (name, value) pairs of str; got "
                f"{_shown(header)} among them"
            )
        name, value = header
        if not (name.isascii() and value.isascii()):
            _check_text(name, value)
        if "\x00" in name or "\x00" in value:
            # The value is not shown: a header may hold a secret.
            shown = "a header's name" if "\x00" in name else f"the {name[:40]!r} header's value"
            raise UsageError(
                f"Response headers must not contain NUL characters: {shown} holds one "
                "(PostgreSQL's jsonb cannot store U+0000)"
            )
        pairs.append((name, value))
    return tuple(pairs)


def _check_text(name: str, value: str) -> None:
    """Refuse a header that is not Unicode text (a lone surrogate, from ``surrogateescape`` or
    ``\\udXXX``): the stored JSON could not carry it, and the completion would fail far from
    here. The value is not shown: a header may hold a secret."""
    for part, what in ((name, "name"), (value, "value")):
        try:
            part.encode()
        except UnicodeEncodeError as error:
            shown = "a header's" if what == "name" else f"the {name[:40]!r} header's"
            raise UsageError(
                f"Response headers must be Unicode text: {shown} {what} holds a lone surrogate "
                f"at position {error.start} (decode bytes with errors='replace', or keep them "
                "in the body)"
            ) from None


def _shown(header: object) -> str:
    if isinstance(header, tuple | list):
        return "(" + ", ".join(type(part).__name__ for part in header) + ")"
    return f"a {type(header).__name__} {header!r}"[:80]


@refuse_changes
@dataclass(frozen=True, slots=True)
class Won:
    """This caller holds the claim: do the work, then complete with the response.

    ``row`` is where a claim of ``begin()`` put its row (the ctid, valid in that transaction
    only), by which ``commit()`` completes it, and ``xact`` the id of that transaction, by which
    ``commit()`` knows it is still the one open; neither is part of the value, and both are None
    from ``claim()``.
    ``conn`` is the connection whose transaction holds the claim (of ``claim()`` or
    ``begin()``): ``complete()``, ``release()`` and ``commit()`` refuse the claim on any other
    connection, whose transaction cannot see its row. Not part of the value either.
    """

    scope: str
    key: str
    fingerprint: bytes
    claimed_at: datetime
    kind: Literal["won"] = field(default="won", init=False)
    row: bytes | None = field(default=None, repr=False, compare=False)
    xact: bytes | None = field(default=None, repr=False, compare=False)
    conn: object = field(default=None, repr=False, compare=False)


@refuse_changes
@dataclass(frozen=True, slots=True)
class Replay:
    """The key was completed before: answer with the stored response, do nothing else."""

    response: Response
    claimed_at: datetime
    completed_at: datetime
    kind: Literal["replay"] = field(default="replay", init=False)


@refuse_changes
@dataclass(frozen=True, slots=True)
class InFlight:
    """The original is still running (or not visible to this transaction): retry later.

    ``retry_after`` is a suggestion in whole seconds, suitable for an HTTP ``Retry-After``.
    ``reason`` is ``"locked"`` (its transaction is open), ``"incomplete"`` (committed without a
    response), ``"invisible"`` (committed after this transaction's snapshot) or ``"gone"``.
    """

    retry_after: int
    reason: str
    kind: Literal["in_flight"] = field(default="in_flight", init=False)


Claim = Won | Replay | InFlight


# The key store's own way to make the outcomes it returns on every call. A frozen dataclass's
# __init__ sets each field through object.__setattr__. Here the fields are stored in a plain
# class with the same slots (its "fields" twin below), whose attribute stores are the
# interpreter's quickest, and the object then becomes the outcome by taking its class: the same
# object for a third of the client instructions of setting each slot through its descriptor (a
# Won: 2,500 against 6,300, and those 6,300 were half of __init__'s). Only for values the store
# has made or checked itself: these skip Response's checks.
_new = object.__new__


def _fields_of(cls: type) -> type:
    """A class with ``cls``'s slots and nothing else, whose instances can become ``cls``'s.

    CPython lets an object take another class of the same layout (``obj.__class__ = cls``): the
    same slots in the same order, on the same base. Checked here once, on a probe, so that a
    layout that ever differed fails at import rather than at a claim.
    """
    slots = cls.__slots__  # type: ignore[attr-defined]
    fields: type = type(f"_{cls.__name__}Fields", (), {"__slots__": slots})
    probe: Any = _new(fields)
    probe.__class__ = cls
    return fields


_WonFields: Any = _fields_of(Won)
_ReplayFields: Any = _fields_of(Replay)
_ResponseFields: Any = _fields_of(Response)


def _slot(cls: type, name: str) -> Any:
    return cls.__dict__[name].__set__


# For Response.__init__, whose object is already a Response.
_response_status = _slot(Response, "status")
_response_headers = _slot(Response, "headers")
_response_body = _slot(Response, "body")


def won(
    scope: str,
    key: str,
    fingerprint: bytes,
    claimed_at: datetime,
    row: bytes | None = None,
    xact: bytes | None = None,
    conn: object = None,
) -> Won:
    """``Won(scope, key, fingerprint, claimed_at, row=row, xact=xact)``, made faster."""
    made = _new(_WonFields)
    made.scope = scope
    made.key = key
    made.fingerprint = fingerprint
    made.claimed_at = claimed_at
    made.kind = "won"
    made.row = row
    made.xact = xact
    made.conn = conn
    made.__class__ = Won
    return made  # type: ignore[no-any-return]


def replay(response: Response, claimed_at: datetime, completed_at: datetime) -> Replay:
    """``Replay(response, claimed_at, completed_at)``, made faster."""
    made = _new(_ReplayFields)
    made.response = response
    made.claimed_at = claimed_at
    made.completed_at = completed_at
    made.kind = "replay"
    made.__class__ = Replay
    return made  # type: ignore[no-any-return]


def stored_replay(
    status: int | None,
    headers: tuple[Header, ...],
    body: bytes,
    claimed_at: datetime,
    completed_at: datetime,
) -> Replay:
    """``replay(_checked_response(status, headers, body), claimed_at, completed_at)`` in one call:
    the key store's replay of a stored response whose values it checked (see wire.replayed())."""
    response = _new(_ResponseFields)
    response.status = status
    response.headers = headers
    response.body = body
    response.__class__ = Response
    made = _new(_ReplayFields)
    made.response = response
    made.claimed_at = claimed_at
    made.completed_at = completed_at
    made.kind = "replay"
    made.__class__ = Replay
    return made  # type: ignore[no-any-return]


def _checked_response(status: int | None, headers: tuple[Header, ...], body: bytes) -> Response:
    """``Response(status, headers, body)`` for values that already pass its checks (an int or
    None; a tuple of (str, str) tuples; bytes), made without running them again."""
    made = _new(_ResponseFields)
    made.status = status
    made.headers = headers
    made.body = body
    made.__class__ = Response
    return made  # type: ignore[no-any-return]


#: At most 4 UTF-8 bytes a character: a scope or key up to this many characters needs no encoding
#: to be known within MAX_KEY_BYTES (a module constant: ``MAX_KEY_BYTES // 4`` at each use is a
#: division per check).
QUICK_KEY_CHARS = MAX_KEY_BYTES // 4


def validate_key(scope: str, key: str) -> None:
    """Raise :class:`UsageError` for a scope or key PostgreSQL cannot store or pgonce refuses."""
    if (
        type(scope) is str
        and type(key) is str
        and scope  # not empty (a str)
        and len(scope) <= QUICK_KEY_CHARS
        and key
        and len(key) <= QUICK_KEY_CHARS
        and "\x00" not in scope
        and "\x00" not in key
    ):
        return
    for what, value in (("scope", scope), ("key", key)):
        if not isinstance(value, str):
            raise UsageError(f"the {what} must be a str, not {type(value).__name__}")
        size = len(value.encode("utf-8", "surrogatepass"))
        if size == 0:
            raise UsageError(f"the {what} must not be empty")
        if size > MAX_KEY_BYTES:
            raise UsageError(
                f"the {what} is {size} bytes long; at most {MAX_KEY_BYTES} are allowed"
            )
        if "\x00" in value:
            raise UsageError(f"the {what} must not contain NUL characters")


def validate_fingerprint(value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != FINGERPRINT_SIZE:
        raise UsageError(
            f"a fingerprint is {FINGERPRINT_SIZE} bytes of SHA-256 (pgonce.fingerprint() makes one)"
        )


def validate_response(response: object) -> None:
    """Refuse anything but a :class:`Response` or ``None`` as what a claim completes with."""
    if response is not None and not isinstance(response, Response):
        raise UsageError(
            f"the response must be a pgonce Response or None, not {type(response).__name__}: "
            "build one with Response(status, headers, body)"
        )


def validate_claim(claim: object, *, won: bool = False) -> None:
    """Refuse anything but a claim outcome (only :class:`Won` when ``won``)."""
    expected = Won if won else (Won, Replay, InFlight)
    if not isinstance(claim, expected):
        what = "a won claim (the Won that claim() or begin() returned)" if won else "a claim"
        raise UsageError(f"{what} is expected, not {type(claim).__name__}")


@dataclass(slots=True)
class ClaimRow:
    """The facts the claim statement returns, before any decision.

    Internal and short-lived (made, decided, dropped), so not frozen: a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``, and cost a replay 12,000 client
    instructions here against 3,000.
    """

    state: str
    fingerprint: bytes | None
    claimed_at: datetime | None
    completed_at: datetime | None
    status: int | None
    headers: Sequence[Sequence[str]] | None
    body: bytes | None


def decide(
    row: ClaimRow,
    *,
    scope: str,
    key: str,
    fingerprint: bytes,
    retry_after: int,
    conn: object = None,
) -> Claim:
    """Map the claim statement's row to an outcome; raise :class:`KeyMismatch` on a mismatch.

    ``conn``: the connection that made the claim, kept on a :class:`Won` (see there).

    A different fingerprint is a mismatch whether or not the original has completed: a retry with
    another request is an error the client must see, never a wait followed by a surprise.
    """
    if row.state == "won":
        assert row.claimed_at is not None
        return won(scope, key, fingerprint, row.claimed_at, None, None, conn)
    if row.state == "existing":
        assert row.fingerprint is not None
        assert row.claimed_at is not None
        stored = row.fingerprint
        if not hmac.compare_digest(stored if type(stored) is bytes else bytes(stored), fingerprint):
            raise KeyMismatch(scope, key)
        if row.completed_at is None or row.headers is None:
            # No response stored: a claim() committed before its completion, or a begin() claim
            # (born with completed_at) whose transaction was committed by hand before commit().
            return InFlight(retry_after=retry_after, reason="incomplete")
        return replay(
            Response.from_stored(row.status, row.headers, row.body),
            row.claimed_at,
            row.completed_at,
        )
    if row.state in ("locked", "invisible", "gone"):
        return InFlight(retry_after=retry_after, reason=row.state)
    raise AssertionError(f"unknown claim state {row.state!r}")
