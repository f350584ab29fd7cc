"""A codec whose ``encode()`` returns something other than bytes (a str, None).

The refusal was a Response's ("Response body must be bytes ... say which encoding in a
Content-Type header"), about a Response the caller never built. It names the codec now; nothing
is stored and the key stays free, joined or owned; bytes-like results are stored as bytes.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import UsageError, idempotent


class Returns:
    content_type = "text/plain"

    def __init__(self, encoded: object) -> None:
        self.encoded = encoded

    def encode(self, value: object) -> Any:
        return self.encoded

    def decode(self, data: bytes) -> bytes:
        return data


def count(dsn: str) -> object:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    return row[0] if row else None


@pytest.mark.parametrize("commit", [False, True], ids=["joined", "owned"])
@pytest.mark.parametrize("encoded", ["text", None], ids=["str", "none"])
def test_a_codec_that_returns_no_bytes_is_named(dsn: str, commit: bool, encoded: object) -> None:
    @idempotent(key="k", scope=f"codec-{commit}", codec=Returns(encoded), commit=commit)
    def run(conn: psycopg.Connection[Any], k: str) -> str:
        return k

    with psycopg.connect(dsn, autocommit=commit) as conn:
        with pytest.raises(UsageError, match=r"the codec's encode\(\) returned") as refused:
            run(conn, "k-1")
        assert "Response" not in str(refused.value)
        if not commit:
            conn.commit()
    assert count(dsn) == 0


@pytest.mark.parametrize("commit", [False, True], ids=["joined", "owned"])
def test_bytes_like_results_are_stored_as_bytes(dsn: str, commit: bool) -> None:
    @idempotent(key="k", scope=f"view-{commit}", codec=Returns(memoryview(b"ab")), commit=commit)
    def run(conn: psycopg.Connection[Any], k: str) -> object:
        return k

    with psycopg.connect(dsn, autocommit=commit) as conn:
        assert run(conn, "k-1") == b"ab"
        if not commit:
            conn.commit()
        assert run(conn, "k-1") == b"ab"
    assert count(dsn) == 1
