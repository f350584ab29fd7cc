"""What makes two HTTP requests "the same request": the fingerprint an Idempotency-Key is bound to.

The fingerprint covers the method, the path, the query string and the body. With canonical JSON on
(the default for ``application/json`` and ``+json`` bodies), two bodies that differ only in object
key order or insignificant whitespace are the same request; anything else (another value, another
number spelling such as ``1`` and ``1.0``, a duplicated object key) is a different request. A body
that does not parse as JSON is fingerprinted byte for byte, so it can never collide with a parsed
one: each form carries its own tag into the hash.
"""

from __future__ import annotations

import functools
import json
import operator
from hashlib import sha256
from json.scanner import make_scanner
from typing import Any

from pgonce.core.fingerprint import length


class _Canonical(str):
    """JSON text already in canonical form: a number as the client wrote it (no float rounding,
    no collisions), or an object whose members were made canonical while it was parsed."""


class _DuplicateKey(ValueError):
    pass


_quote = json.encoder.encode_basestring  # what json.dumps(ensure_ascii=False) does to a str
_CONSTANTS = {True: "true", False: "false", None: "null"}
_name = operator.itemgetter(0)


def _canonical(value: Any) -> str:
    kind = type(value)
    if kind is _Canonical:
        return value  # type: ignore[no-any-return]
    if kind is str:
        return _quote(value)
    if kind is list:
        return "[" + ",".join([_canonical(item) for item in value]) + "]"
    return _CONSTANTS[value]  # true, false, null


def _object(pairs: list[tuple[str, Any]]) -> _Canonical:
    # The parser calls this for every object, innermost first, with its members in the order
    # written: each object becomes canonical text as soon as it is read, with no second pass.
    pairs.sort(key=_name)
    members = []
    previous = None
    for name, value in pairs:
        if name == previous:
            # {"a": 1, "a": 2} and {"a": 2} must not be the same request.
            raise _DuplicateKey
        previous = name
        # _canonical(value), its two usual answers without the call.
        kind = type(value)
        if kind is _Canonical:
            members.append(_quote(name) + ":" + value)
        elif kind is str:
            members.append(_quote(name) + ":" + _quote(value))
        else:
            members.append(_quote(name) + ":" + _canonical(value))
    return _Canonical("{" + ",".join(members) + "}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# One scanner for every call (json.loads() with hooks builds a new decoder each time), called
# directly: what JSONDecoder.decode() does, without its two Python calls around it. The scanner
# reads its hooks from the decoder (typeshed types that context as the scanner itself).
_scan = make_scanner(
    json.JSONDecoder(  # type: ignore[arg-type]
        object_pairs_hook=_object,
        parse_int=_Canonical,
        parse_float=_Canonical,
        parse_constant=_reject_constant,
    )
)
_WHITESPACE = " \t\n\r"  # JSON's insignificant whitespace (RFC 8259)


def _encoding(body: bytes) -> str:
    """json.detect_encoding(), answered at once for the usual body: no BOM, no NUL in its first
    two bytes (UTF-16 and -32 have one there) -- UTF-8. (:func:`canonical_json` makes the same
    test inline before it calls this.)"""
    if len(body) >= 2 and 0 < body[0] < 0x80 and body[1]:
        return "utf-8"
    return json.detect_encoding(body)


def canonical_json(body: bytes) -> bytes | None:
    """``body`` as canonical JSON (sorted keys, no whitespace), or ``None`` if it is not JSON.

    The canonical form is hashed, never sent: a lone surrogate, which JSON may escape (``\\ud800``)
    but UTF-8 cannot carry, is kept as its code point's bytes ("surrogatepass"). A document
    nested too deep for the interpreter's stack is "not JSON" here (its bytes are hashed as
    they are), never an error.
    """
    try:
        # What json.loads() does with bytes (UTF-8, -16 or -32, told apart by the first bytes).
        usual = len(body) >= 2 and 0 < body[0] < 0x80 and body[1]  # _encoding()'s first test
        text = body.decode("utf-8" if usual else _encoding(body), "surrogatepass")
        value, end = _scan(text, len(text) - len(text.lstrip(_WHITESPACE)))
        if text[end:].strip(_WHITESPACE):
            return None  # text after the document
        if type(value) is not _Canonical:  # an object or a number is already canonical text
            value = _canonical(value)
        return value.encode("utf-8", "surrogatepass")  # type: ignore[no-any-return]
    except (ValueError, RecursionError, StopIteration):
        return None


@functools.lru_cache(maxsize=64)
def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (``application/json`` or a ``+json`` suffix).

    Remembered for the last few types: an application sends the same two or three, and each
    request would otherwise split and lower its Content-Type again."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def request_fingerprint(
    method: str,
    path: str,
    query: bytes,
    body: bytes,
    *,
    content_type: str | None = None,
    canonicalize_json: bool = True,
) -> bytes:
    """SHA-256 over method, path, query string and body (canonical when it is JSON and asked).

    The digest is ``fingerprint(method.upper(), path, query, b"json" or b"raw", body)``, written
    out: the generic loop over five parts cost a third of the hashing (the tests hold the two
    equal).
    """
    tag = _RAW
    if canonicalize_json and is_json(content_type):
        canonical = canonical_json(body)
        if canonical is not None:
            tag, body = _JSON, canonical
    return sha256(
        b"".join((_head(method, path), length(len(query)), query, tag, length(len(body)), body))
    ).digest()


@functools.lru_cache(maxsize=128)
def _head(method: str, path: str) -> bytes:
    """The fingerprint's first parts, the method and the path with their lengths: remembered
    for the last few routes, which an application's requests repeat."""
    verb, where = method.upper().encode(), path.encode()
    return length(len(verb)) + verb + length(len(where)) + where


# The two forms' tags, each with its length as a part: a canonical body never collides with raw
# bytes that spell the same text.
_JSON = length(4) + b"json"
_RAW = length(3) + b"raw"
