"""The replayed headers the Idempotency-Key page lists: a 204 or 304 goes without Content-Length,
as it was sent, and Set-Cookie, hop-by-hop headers and Date are never replayed."""

from __future__ import annotations

import pytest

from pgonce import Response
from pgonce.http.replay import replay_headers, storable_pairs

SENT = [
    (b"content-type", b"application/json"),
    (b"etag", b'"v1"'),
    (b"set-cookie", b"session=secret"),
    (b"connection", b"keep-alive"),
    (b"transfer-encoding", b"chunked"),
    (b"date", b"Sun, 06 Dec 2026 17:00:00 GMT"),
    (b"content-length", b"2"),
]


@pytest.mark.parametrize(
    ("status", "length"), [(200, True), (201, True), (204, False), (304, False)]
)
def test_a_replay_carries_content_length_only_where_the_answer_did(
    status: int, length: bool
) -> None:
    body = b"{}" if length else b""
    response = Response(status, tuple(storable_pairs(SENT)), body)
    names = [name for name, _ in replay_headers(response)]
    assert (b"content-length" in names) is length
    assert names[:2] == [b"content-type", b"etag"]
    assert b"idempotent-replayed" in names
    for gone in (b"set-cookie", b"connection", b"transfer-encoding", b"date"):
        assert gone not in names
