"""What makes two HTTP requests "the same request": the fingerprint an Idempotency-Key is bound to.

The fingerprint covers the method, the path, the query string and the body. With canonical JSON on
(the default for ``application/json`` and ``+json`` bodies), two bodies that differ only in object
key order or insignificant whitespace are the same request; anything else (another value, another
number spelling such as ``1`` and ``1.0``, a duplicated object key) is a different request. A body
that does not parse as JSON is fingerprinted byte for byte, so it can never collide with a parsed
one: each form carries its own tag into the hash.
"""

from __future__ import annotations

import json
from typing import Any

from pgonce.core.fingerprint import fingerprint


class _Number(str):
    """A JSON number kept exactly as the client wrote it (no float rounding, no collisions)."""


class _DuplicateKey(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        # {"a": 1, "a": 2} and {"a": 2} must not be the same request.
        raise _DuplicateKey
    return result


# One encoder for names and scalars: json.dumps() with an argument builds a new one per call.
_scalar = json.JSONEncoder(ensure_ascii=False).encode


def _write(value: Any, out: list[str]) -> None:
    if isinstance(value, dict):
        out.append("{")
        for index, name in enumerate(sorted(value)):
            if index:
                out.append(",")
            out.append(_scalar(name))
            out.append(":")
            _write(value[name], out)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _write(item, out)
        out.append("]")
    elif isinstance(value, _Number):
        out.append(str(value))
    else:  # str, bool, None: json.dumps spells them canonically
        out.append(_scalar(value))


def canonical_json(body: bytes) -> bytes | None:
    """``body`` as canonical JSON (sorted keys, no whitespace), or ``None`` if it is not JSON.

    The canonical form is hashed, never sent: a lone surrogate, which JSON may escape (``\\ud800``)
    but UTF-8 cannot carry, is kept as its code point's bytes ("surrogatepass").
    """
    try:
        # What json.loads() does with bytes (UTF-8, -16 or -32, told apart by the first bytes),
        # with one decoder for every call: json.loads() with hooks builds a new one each time.
        value = _decoder.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except (ValueError, RecursionError):
        return None
    out: list[str] = []
    _write(value, out)
    return "".join(out).encode("utf-8", "surrogatepass")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_decoder = json.JSONDecoder(
    object_pairs_hook=_object,
    parse_int=_Number,
    parse_float=_Number,
    parse_constant=_reject_constant,
)


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (``application/json`` or a ``+json`` suffix)."""
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
    """SHA-256 over method, path, query string and body (canonical when it is JSON and asked)."""
    if canonicalize_json and is_json(content_type):
        canonical = canonical_json(body)
        if canonical is not None:
            return fingerprint(method.upper(), path, query, b"json", canonical)
    return fingerprint(method.upper(), path, query, b"raw", body)
