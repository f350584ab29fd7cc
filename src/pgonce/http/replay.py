"""Which response headers are stored for a replay, and how a stored response is sent again.

A replay answers with the original status and the byte-identical body, and with the application's
own headers (``Location``, ``Content-Type``, custom ones) in their original order. Never replayed:

- ``Set-Cookie``: a cookie is a session handed to one exchange; replaying it to whoever holds the
  key would hand the session out again. The response is still stored and protected; only the
  cookie is left out.
- hop-by-hop headers (RFC 9110 section 7.6.1: ``Connection``, ``Keep-Alive``, ``Transfer-Encoding``,
  ``TE``, ``Trailer``, ``Upgrade``, ``Proxy-*``): they describe one connection, not the response.
- ``Content-Length`` and ``Date``: recomputed for every answer, so they are never stale (and
  never sent with a 1xx, 204 or 304, as the original was not).
- the headers this middleware adds itself, so that they are never doubled.

Every replay carries ``Idempotent-Replayed: true``.
"""

from __future__ import annotations

from collections.abc import Iterable

from pgonce.core.outcomes import Header, Response

#: Marks an answer that came from the key store instead of the endpoint.
REPLAYED_HEADER = "idempotent-replayed"

#: Until when (an HTTP-date) the key is honoured: a retry before then gets the stored response.
#: The draft leaves this open; the name follows the request header's and ``Expires``.
EXPIRES_HEADER = "idempotency-key-expires"

_NOT_STORED = frozenset(
    {
        "set-cookie",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "date",
        REPLAYED_HEADER,
        EXPIRES_HEADER,
    }
)

#: Statuses whose answer never carries Content-Length (RFC 9110 section 8.6: never on a 1xx or
#: 204; on a 304 it would describe the representation, which is not stored): as sent the first
#: time.
_NO_CONTENT_LENGTH = frozenset({204, 304})

RawHeaders = list[tuple[bytes, bytes]]


def storable_pairs(raw: Iterable[tuple[bytes, bytes]]) -> list[Header]:
    """The headers of an ASGI response start that a replay may send again, in order, as a list
    of new pairs (what :func:`~pgonce.core.outcomes.new_response` takes).

    A plain loop: a comprehension that names the lower-cased name (``:=``) makes it a closure
    cell, and costs more instructions than the loop's ``append``.
    """
    kept: list[Header] = []
    for name, value in raw:
        text = name.decode("latin-1").lower()
        if text not in _NOT_STORED:
            kept.append((text, value.decode("latin-1")))
    return kept


def storable_text_pairs(headers: Iterable[tuple[str, str]]) -> list[Header]:
    """:func:`storable_pairs` of headers that are already text (WSGI's ``start_response``,
    Django's response), so that they are not encoded only to be decoded again; the names are
    lower-cased as ASGI's are. The caller has checked that they are latin-1."""
    kept: list[Header] = []
    for name, value in headers:
        text = name.lower()
        if text not in _NOT_STORED:
            kept.append((text, value))
    return kept


def encode_headers(headers: Iterable[Header]) -> RawHeaders:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]


def replay_headers(response: Response, extra: Iterable[Header] = ()) -> RawHeaders:
    """ASGI headers for sending ``response`` again from the key store."""
    # Filtered again: rows stored by other code (or an older pgonce) must not leak a cookie either.
    raw = encode_headers(h for h in response.headers if h[0].lower() not in _NOT_STORED)
    status = response.status
    if status is None or (status >= 200 and status not in _NO_CONTENT_LENGTH):
        raw.append((b"content-length", str(len(response.body)).encode()))
    raw.append((REPLAYED_HEADER.encode(), b"true"))
    raw.extend(encode_headers(extra))
    return raw
