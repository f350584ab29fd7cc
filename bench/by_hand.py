"""A key by hand: the least an idempotency layer adds to an app's transaction, with no pgonce code.

The adapters' benchmarks set their app with pgonce beside the same app doing pgonce's writes
itself: the key's row inserted at the start of the request's transaction (sent with BEGIN, as
pgonce sends it), the app's own write, and the response stored in that row (sent with COMMIT, as
pgonce sends it). Same round trips, same rows, same commit; none of pgonce's checks, encoding or
error handling. How close the adapter comes to this is how much its own code costs; how far this
falls below the app alone is what storing a key and a response costs, whatever stores it: the
limit of a target set against the app alone.
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
