"""A key by hand: pgonce's writes done by the app itself through psycopg, with no pgonce code.

The adapters' benchmarks set their app with pgonce beside the same app doing pgonce's writes
itself: the key's row inserted at the start of the request's transaction (sent with BEGIN, as
pgonce sends it), the app's own write, and the response stored in that row (sent with COMMIT, as
pgonce sends it). Same round trips, same rows, same commit; none of pgonce's checks, encoding or
error handling, but psycopg's own Python (its pipeline, its adapters) around each statement, which
pgonce's wire layer does without: the adapters outrun it. It shows what the same writes cost a
team that writes them itself.
"""

from __future__ import annotations

from typing import Any

import psycopg

CLAIM = (
    b"INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at)"
    b" VALUES (%s, %s, %s, now(), now()) ON CONFLICT (scope, key) DO NOTHING RETURNING claimed_at"
)
COMPLETE = (
    b"UPDATE pgonce.keys SET response_status = %s, response_headers = %s::jsonb,"
    b" response_body = %s"
    b" WHERE scope = %s AND key = %s AND response_headers IS NULL"
)
#: The stored headers: the app's answer's two, as pgonce stores a JSON response's.
HEADERS = '[["content-type","application/json"],["location","/payments/0"]]'
FINGERPRINT = bytes(32)


def claim(conn: psycopg.Connection[Any], scope: str, key: str) -> None:
    """BEGIN and the key's INSERT in one round trip; a duplicate is not expected here (every
    request of the benchmark has a new key)."""
    with conn.pipeline():
        row = conn.execute(CLAIM, (scope, key, FINGERPRINT)).fetchone()
    if row is None:
        raise RuntimeError(f"the key {key!r} was used twice")


def complete(conn: psycopg.Connection[Any], scope: str, key: str, status: int, body: bytes) -> None:
    """The response's UPDATE and COMMIT in one round trip."""
    with conn.pipeline():
        conn.execute(COMPLETE, (status, HEADERS, body, scope, key))
        conn.commit()
