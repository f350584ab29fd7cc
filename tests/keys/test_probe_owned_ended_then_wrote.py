"""A block in a transaction of pgonce's own (``once(commit=True)``, ``begin()`` with
``commit()``, ``@idempotent(commit=True)``, ``IdempotentConsumer.handle()``) that ends it with a
ROLLBACK or COMMIT in SQL and then goes on writing, on a connection with autocommit off. psycopg
opens a new transaction for the next statement, which hides the end from the store: the
completion and COMMIT then ran in that new transaction. After a ROLLBACK, the writes after it
committed without the claim, nothing was stored and nothing said so (the client's retry ran the
work again); after a COMMIT, the block's work was committed in two transactions and the response
stored as if in one.

Now the completion's guard finds the end and fails the batch before its COMMIT: the writes
after the end roll back, nothing of the new transaction commits, and a UsageError says so. A
ROLLBACK had taken the claim (the key is free, the retry runs the work once, whole); a COMMIT had
committed the claim with the writes before it.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, Response, fingerprint, idempotent
from pgonce.consumers import IdempotentConsumer, Outcome
from pgonce.core.outcomes import InFlight, Replay, Won
from pgonce.errors import UsageError

FP = fingerprint(b"k")


@pytest.fixture
def effects(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as setup:
        setup.execute("CREATE TABLE effects (what text)")


def written(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT what FROM effects ORDER BY what")]


def key_row(dsn: str) -> tuple[Any, ...] | None:
    """The key's row as another connection sees it: whether a response is stored."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT response_headers IS NOT NULL FROM pgonce.keys WHERE key = 'k'"
        ).fetchone()


def after_the_end(dsn: str, end: str) -> None:
    """What a retry finds: after a ROLLBACK nothing of the block, and a free key; after a
    COMMIT the writes before it, and the claim in flight (no response stored)."""
    if end == "ROLLBACK":
        assert written(dsn) == []
        assert key_row(dsn) is None
    else:
        assert written(dsn) == ["before"]
        assert key_row(dsn) == (False,)


ENDS = pytest.mark.parametrize("end", ["ROLLBACK", "COMMIT"])


@pytest.mark.usefixtures("effects")
@ENDS
def test_once_commit_true_ended_then_written_is_refused(dsn: str, end: str) -> None:
    store = KeyStore()
    with psycopg.connect(dsn) as conn:  # autocommit off
        with (
            pytest.raises(UsageError, match="Statements ran after that end") as raised,
            store.once(conn, "s", "k", FP, commit=True) as op,
        ):
            conn.execute("INSERT INTO effects VALUES ('before')")
            conn.execute(end)
            conn.execute("INSERT INTO effects VALUES ('after')")
            op.execute("INSERT INTO effects VALUES ('queued')")
            op.respond(Response(201))
        assert op.stored is False
        assert "ended before commit()" in str(raised.value)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        after_the_end(dsn, end)
        if end == "ROLLBACK":
            # The retry runs the work once, whole.
            with store.once(conn, "s", "k", FP, commit=True) as again:
                assert again.won
                conn.execute("INSERT INTO effects VALUES ('again')")
                again.respond(Response(201))
            assert again.stored is True
            assert written(dsn) == ["again"]
        else:
            assert isinstance(store.begin(conn, "s", "k", FP), InFlight)


@pytest.mark.usefixtures("effects")
@ENDS
def test_begin_and_commit_ended_then_written_is_refused(dsn: str, end: str) -> None:
    store = KeyStore()
    with psycopg.connect(dsn) as conn:
        claim = store.begin(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        conn.execute("INSERT INTO effects VALUES ('before')")
        conn.execute(end)
        conn.execute("INSERT INTO effects VALUES ('after')")
        with pytest.raises(UsageError, match="Statements ran after that end"):
            store.commit(
                conn, claim, Response(201), writes=[("INSERT INTO effects VALUES ('w')", None)]
            )
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    after_the_end(dsn, end)


@pytest.mark.usefixtures("effects")
@ENDS
async def test_the_async_store_refuses_it_too(dsn: str, end: str) -> None:
    store = AsyncKeyStore()
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with pytest.raises(UsageError, match="Statements ran after that end"):
            async with store.once(conn, "s", "k", FP, commit=True) as op:
                await conn.execute("INSERT INTO effects VALUES ('before')")
                await conn.execute(end)
                await conn.execute("INSERT INTO effects VALUES ('after')")
                op.respond(Response(201))
    after_the_end(dsn, end)


@pytest.mark.usefixtures("effects")
@ENDS
async def test_idempotent_commit_true_refuses_it(dsn: str, end: str) -> None:
    @idempotent(key="order", scope="s", commit=True)
    async def ship(conn: psycopg.AsyncConnection[Any], order: str) -> None:
        await conn.execute("INSERT INTO effects VALUES ('before')")
        await conn.execute(end)
        await conn.execute("INSERT INTO effects VALUES ('after')")

    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with pytest.raises(UsageError, match="Statements ran after that end"):
            await ship(conn, "k")
    after_the_end(dsn, end)


@pytest.mark.usefixtures("effects")
@ENDS
async def test_a_consumers_handler_that_ended_and_wrote_on_is_told(dsn: str, end: str) -> None:
    async def handler(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES ('before')")
        await conn.execute(end)
        await conn.execute("INSERT INTO effects VALUES ('after')")

    consumer = IdempotentConsumer("shipping")
    async with await psycopg.AsyncConnection.connect(dsn) as conn:  # autocommit off
        with pytest.raises(UsageError, match="committed or rolled back") as raised:
            outcome = await consumer.handle(conn, "k", b"{}", handler)
            pytest.fail(f"handle() answered {outcome} (acknowledge: {outcome.acknowledge})")
        assert isinstance(raised.value.__cause__, UsageError)
        assert "Statements ran after that end" in str(raised.value.__cause__)

        async def again(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute("INSERT INTO effects VALUES ('again')")

        redelivered = await consumer.handle(conn, "k", b"{}", again)
    if end == "ROLLBACK":
        # Nothing was done: the redelivery runs the handler once, whole.
        assert redelivered is Outcome.PROCESSED
        assert written(dsn) == ["again"]
    else:
        # The COMMIT had committed the claim with the writes before it; handle() completed it
        # after the refusal, so the redelivery is a duplicate. What ran after the COMMIT did not
        # commit.
        assert redelivered is Outcome.DUPLICATE
        assert written(dsn) == ["before"]


def test_a_completion_in_the_transaction_still_leaves_commit_false(dsn: str) -> None:
    # The guard fails only an ended transaction: commit() after complete() in begin()'s own
    # transaction still finds no row to complete and answers False, committing the first.
    store = KeyStore()
    with psycopg.connect(dsn) as conn:
        claim = store.begin(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        with conn.transaction():  # a savepoint rolled back in the block leaves the guard be
            conn.execute("SELECT 1")
        assert store.complete(conn, claim, Response(201, body=b"first")) is True
        assert store.commit(conn, claim, Response(201, body=b"second")) is False
        replay = store.begin(conn, "s", "k", FP)
        assert isinstance(replay, Replay)
        assert replay.response.body == b"first"
