"""The Idempotency-Key request header: parsing and validation.

draft-ietf-httpapi-idempotency-key-header defines the field as a Structured Field Item whose value
is a String (RFC 8941: ``Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"``). Many clients
send the bare value instead (Stripe's documentation does), so both spellings are accepted and mean
the same key: ``"abc"`` equals ``abc``. Everything else is refused with
:class:`~pgonce.errors.InvalidIdempotencyKey` (a 400 problem response at the middleware):

- a missing header, when the route requires one;
- the header sent more than once (a retry must carry exactly one key);
- an empty key, or one longer than 255 characters (Stripe's limit, and the store's columns are
  bounded too);
- control characters or anything outside visible ASCII and space (an sf-string allows no more);
- a quoted value with a broken escape or a missing closing quote.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pgonce.errors import InvalidIdempotencyKey

#: The request header, lower-case as ASGI delivers header names.
HEADER = b"idempotency-key"

#: Longest key accepted, in characters (visible ASCII, so also in bytes). Stripe documents the same
#: limit; it keeps keys readable in logs and well inside the key store's bounds.
MAX_KEY_LENGTH = 255


def _unquote(value: str) -> str:
    """The content of an RFC 8941 sf-string (``value`` starts with a double quote)."""
    chars: list[str] = []
    index = 1
    while index < len(value):
        char = value[index]
        if char == "\\":
            index += 1
            if index >= len(value) or value[index] not in '"\\':
                raise InvalidIdempotencyKey(
                    'a quoted Idempotency-Key may escape only " and \\ with a backslash'
                )
            chars.append(value[index])
        elif char == '"':
            if index != len(value) - 1:
                raise InvalidIdempotencyKey("the quoted Idempotency-Key has text after its end")
            return "".join(chars)
        else:
            chars.append(char)
        index += 1
    raise InvalidIdempotencyKey("the quoted Idempotency-Key has no closing quote")


def parse_key(value: str) -> str:
    """The key carried by one Idempotency-Key field value (sf-string or bare)."""
    value = value.strip(" \t")
    # ASCII and printable is exactly space to tilde (tab, DEL and other controls are not printable).
    if not (value.isascii() and value.isprintable()):
        raise InvalidIdempotencyKey(
            "the Idempotency-Key must contain only visible ASCII characters and spaces"
        )
    key = _unquote(value) if value.startswith('"') else value
    if not key:
        raise InvalidIdempotencyKey("the Idempotency-Key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidIdempotencyKey(
            f"the Idempotency-Key must be at most {MAX_KEY_LENGTH} characters long"
        )
    return key


def key_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key of an ASGI request's headers; ``None`` when there is no Idempotency-Key header."""
    return key_of([value for name, value in headers if name.lower() == HEADER])


def key_of(values: Sequence[bytes]) -> str | None:
    """The key carried by a request's Idempotency-Key field values (none: ``None``)."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidIdempotencyKey("send exactly one Idempotency-Key header")
    return parse_key(values[0].decode("latin-1"))
