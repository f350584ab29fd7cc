"""A batch larger than the socket's buffer waits to send, then for its answers, on the loop.

Its completion (the response's body with COMMIT) cannot be written in one go: the round trip
waits for the socket to take more before it waits for the answers, and the replay reads the
body back in more than one wait. Both on asyncio's loop and on uvloop.
"""

from __future__ import annotations

import psycopg

from pgonce import AsyncKeyStore, Response, fingerprint

FP = fingerprint("a large body")
# Far more than a socket's send buffer (TCP or Unix), on any of the test routes.
BODY = bytes(range(256)) * (32 * 1024 * 1024 // 256)


async def test_a_response_larger_than_the_socket_buffer_is_stored_and_replayed(
    dsn: str, astore: AsyncKeyStore
) -> None:
    response = Response(201, (("content-type", "application/octet-stream"),), BODY)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with astore.once(conn, "s", "big", FP, commit=True) as op:
            op.respond(response)
        assert op.stored
        for _ in range(2):
            async with astore.once(conn, "s", "big", FP, commit=True) as op:
                assert op.replayed
                assert op.response == response
        cur = await conn.execute(
            "SELECT length(response_body) FROM pgonce.keys WHERE scope = 's' AND key = 'big'"
        )
        assert await cur.fetchone() == (len(BODY),)
