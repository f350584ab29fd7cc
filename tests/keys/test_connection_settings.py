"""The key store and the outbox on connections configured as applications configure them: the
session's DateStyle and client_encoding, characters an encoding cannot carry, a queued write that
psycopg refuses, a closed connection."""

from __future__ import annotations

import psycopg
import pytest

from pgonce import (
    AsyncKeyStore,
    DatabaseUnavailable,
    KeyStore,
    Replay,
    Response,
    UsageError,
    Won,
    enqueue,
    fingerprint,
)
from tests.keys.test_key_store import effects

FP = fingerprint("POST", "/orders", b'{"amount": 42}')
RESPONSE = Response(201, (("content-type", "text/plain"), ("x-name", "Zoë")), b"\x00\xff body")

# DateStyles in which PostgreSQL writes a timestamptz as text that psycopg cannot parse.
DATESTYLES = ["SQL,DMY", "German", "Postgres,MDY"]


def rows(dsn: str, key: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT count(*) FROM pgonce.keys WHERE key = %s", (key,)).fetchone()
        assert row is not None
        return int(row[0])


def stored(dsn: str, key: str, store: KeyStore) -> None:
    """Store RESPONSE for ``key`` from a plain UTF-8 connection."""
    with psycopg.connect(dsn) as c:
        with store.once(c, "tenant", key, FP) as op:
            assert op.won
            op.respond(RESPONSE)
        c.commit()


@pytest.mark.parametrize("datestyle", DATESTYLES)
def test_claim_and_replay_whatever_the_datestyle(dsn: str, store: KeyStore, datestyle: str) -> None:
    with psycopg.connect(dsn, options=f"-c DateStyle={datestyle}") as c:
        claim = store.claim(c, "tenant", "k1", FP)
        assert isinstance(claim, Won)
        assert store.complete(c, claim, RESPONSE) is True
        c.commit()
        replay = store.claim(c, "tenant", "k1", FP)
        c.commit()
    assert isinstance(replay, Replay)
    assert replay.response == RESPONSE
    assert replay.claimed_at == claim.claimed_at


@pytest.mark.parametrize("datestyle", DATESTYLES)
def test_once_in_a_pipeline_whatever_the_datestyle(
    dsn: str, store: KeyStore, datestyle: str
) -> None:
    with psycopg.connect(dsn, options=f"-c DateStyle={datestyle}") as c:
        with c.pipeline(), store.once(c, "tenant", "k1", FP) as op:
            assert op.won
            op.respond(RESPONSE)
        c.commit()
        with c.pipeline(), store.once(c, "tenant", "k1", FP) as again:
            assert again.replayed
        c.commit()
    assert again.response == RESPONSE


@pytest.mark.parametrize("datestyle", DATESTYLES)
async def test_async_claim_whatever_the_datestyle(
    dsn: str, astore: AsyncKeyStore, datestyle: str
) -> None:
    options = f"-c DateStyle={datestyle}"
    async with await psycopg.AsyncConnection.connect(dsn, options=options) as c:
        claim = await astore.claim(c, "tenant", "k1", FP)
        assert isinstance(claim, Won)
        assert await astore.complete(c, claim, RESPONSE) is True
        await c.commit()
        replay = await astore.claim(c, "tenant", "k1", FP)
        await c.commit()
    assert isinstance(replay, Replay)
    assert replay.response == RESPONSE


SQL_ASCII = "-c client_encoding=SQL_ASCII"


@pytest.mark.parametrize("commit", [False, True])
def test_sql_ascii_connection_replays_a_response_with_non_ascii_headers(
    dsn: str, store: KeyStore, commit: bool
) -> None:
    stored(dsn, "k1", store)
    with psycopg.connect(dsn, options=SQL_ASCII) as c:
        with store.once(c, "tenant", "k1", FP, commit=commit) as op:
            assert op.replayed
        c.commit()
    assert op.response == RESPONSE


def test_sql_ascii_connection_claims_with_claim(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn, options=SQL_ASCII) as c:
        claim = store.claim(c, "tenant", "k1", FP)
        assert isinstance(claim, Won)
        store.complete(c, claim, RESPONSE)
        c.commit()
        with c.pipeline(), store.once(c, "tenant", "k1", FP) as op:
            assert op.replayed
        c.commit()
    assert op.response == RESPONSE


@pytest.mark.parametrize("commit", [False, True])
def test_sql_ascii_connection_finds_a_non_ascii_key_that_utf8_stored(
    dsn: str, store: KeyStore, commit: bool
) -> None:
    key = "clé-€"
    with psycopg.connect(dsn) as c:
        with store.once(c, "tenant", key, FP) as op:
            op.respond(RESPONSE)
        c.commit()
    with psycopg.connect(dsn, options=SQL_ASCII) as c:
        with store.once(c, "tenant", key, FP, commit=commit) as op:
            assert op.replayed
        c.commit()
    assert rows(dsn, key) == 1


@pytest.mark.parametrize("commit", [False, True])
async def test_async_sql_ascii_connection_claims_a_non_ascii_key(
    dsn: str, astore: AsyncKeyStore, commit: bool
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, options=SQL_ASCII) as c:
        async with astore.once(c, "tenant", "clé", FP, commit=commit) as op:
            assert op.won
            op.respond(RESPONSE)
        await c.commit()
    async with await psycopg.AsyncConnection.connect(dsn) as c:
        async with astore.once(c, "tenant", "clé", FP) as op:
            assert op.replayed
        await c.commit()
    assert op.response == RESPONSE


# A lone surrogate is in no encoding; the euro sign is not in LATIN1.
UNENCODABLE = [("UTF8", "key-\ud800"), ("LATIN1", "key-€")]


@pytest.mark.parametrize(("encoding", "key"), UNENCODABLE)
@pytest.mark.parametrize("how", ["once", "once-commit", "once-pipeline", "claim", "begin"])
def test_a_key_the_connection_cannot_send_is_a_usage_error(
    dsn: str, store: KeyStore, encoding: str, key: str, how: str
) -> None:
    with psycopg.connect(dsn, options=f"-c client_encoding={encoding}") as c:
        with pytest.raises(UsageError, match="cannot be sent in the connection's encoding"):
            if how == "claim":
                store.claim(c, "tenant", key, FP)
            elif how == "begin":
                store.begin(c, "tenant", key, FP)
            elif how == "once-pipeline":
                with c.pipeline(), store.once(c, "tenant", key, FP):
                    pass
            else:
                with store.once(c, "tenant", key, FP, commit=how == "once-commit"):
                    pass
        c.rollback()
        assert c.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.parametrize(("encoding", "key"), UNENCODABLE)
async def test_async_a_key_the_connection_cannot_send_is_a_usage_error(
    dsn: str, astore: AsyncKeyStore, encoding: str, key: str
) -> None:
    options = f"-c client_encoding={encoding}"
    async with await psycopg.AsyncConnection.connect(dsn, options=options) as c:
        with pytest.raises(UsageError, match="cannot be sent in the connection's encoding"):
            async with astore.once(c, "tenant", key, FP):
                pass
        with pytest.raises(UsageError, match="cannot be sent in the connection's encoding"):
            await astore.claim(c, "tenant", key, FP)


@pytest.mark.parametrize(("encoding", "aggregate"), UNENCODABLE)
def test_enqueue_of_an_aggregate_the_connection_cannot_send_is_a_usage_error(
    dsn: str, encoding: str, aggregate: str
) -> None:
    with (
        psycopg.connect(dsn, options=f"-c client_encoding={encoding}") as c,
        pytest.raises(UsageError, match="cannot be sent in the connection's encoding"),
    ):
        enqueue(c, "order", aggregate, "created", {"total": 1})


@pytest.mark.parametrize("commit", [False, True])
def test_a_queued_write_psycopg_refuses_leaves_nothing_behind(
    dsn: str, store: KeyStore, commit: bool
) -> None:
    with psycopg.connect(dsn) as c:
        c.execute("CREATE TABLE effects (key text)")
        c.commit()
        with (
            pytest.raises(psycopg.ProgrammingError, match="placeholders"),
            store.once(c, "tenant", "k1", FP, commit=commit) as op,
        ):
            c.execute("INSERT INTO effects VALUES ('k1')")
            op.execute("INSERT INTO effects VALUES (%s, %s)", ("k1",))
            op.respond(RESPONSE)
        # A caller that handles the error and commits what else its transaction holds.
        c.commit()
    assert rows(dsn, "k1") == 0
    assert effects(dsn, "k1") == 0


@pytest.mark.parametrize("commit", [False, True])
async def test_async_a_queued_write_psycopg_refuses_leaves_nothing_behind(
    dsn: str, astore: AsyncKeyStore, commit: bool
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as c:
        await c.execute("CREATE TABLE effects (key text)")
        await c.commit()
        with pytest.raises(psycopg.ProgrammingError, match="placeholders"):
            async with astore.once(c, "tenant", "k1", FP, commit=commit) as op:
                await c.execute("INSERT INTO effects VALUES ('k1')")
                op.execute("INSERT INTO effects VALUES (%s, %s)", ("k1",))
                op.respond(RESPONSE)
        await c.commit()
    assert rows(dsn, "k1") == 0
    assert effects(dsn, "k1") == 0


@pytest.mark.parametrize("commit", [False, True])
def test_once_on_a_closed_connection_is_database_unavailable(
    dsn: str, store: KeyStore, commit: bool
) -> None:
    c = psycopg.connect(dsn)
    c.close()
    with (
        pytest.raises(DatabaseUnavailable, match="closed"),
        store.once(c, "tenant", "k1", FP, commit=commit),
    ):
        pass


@pytest.mark.parametrize("commit", [False, True])
async def test_async_once_on_a_closed_connection_is_database_unavailable(
    dsn: str, astore: AsyncKeyStore, commit: bool
) -> None:
    c = await psycopg.AsyncConnection.connect(dsn)
    await c.close()
    with pytest.raises(DatabaseUnavailable, match="closed"):
        async with astore.once(c, "tenant", "k1", FP, commit=commit):
            pass


def test_replay_keeps_its_times_whatever_the_session_time_zone(dsn: str, store: KeyStore) -> None:
    stored(dsn, "k1", store)
    with psycopg.connect(dsn) as c:
        with store.once(c, "tenant", "k1", FP) as reference:
            pass
        c.commit()
    options = "-c TimeZone=America/St_Johns -c DateStyle=German -c IntervalStyle=sql_standard"
    with psycopg.connect(dsn, options=options) as c:
        with store.once(c, "tenant", "k1", FP) as op:
            pass
        c.commit()
        claim = store.claim(c, "tenant", "k1", FP)
        c.commit()
    assert isinstance(op.claim, Replay)
    assert isinstance(claim, Replay)
    assert isinstance(reference.claim, Replay)
    assert op.claim.claimed_at == claim.claimed_at == reference.claim.claimed_at
    assert op.claim.completed_at == claim.completed_at == reference.claim.completed_at
    assert op.response == claim.response == RESPONSE


@pytest.mark.parametrize("commit", [False, True])
def test_an_operation_block_runs_once(dsn: str, store: KeyStore, commit: bool) -> None:
    with psycopg.connect(dsn) as c:
        c.execute("CREATE TABLE effects (key text)")
        c.commit()
        op = store.once(c, "tenant", "k1", FP, commit=commit)
        with op:
            assert op.won
            op.execute("INSERT INTO effects VALUES (%s)", ("k1",))
            op.respond(Response(503))  # not stored: the key stays free
        c.commit()
        with pytest.raises(UsageError, match="block has ended"):
            op.respond(RESPONSE)
        with pytest.raises(UsageError, match="block has ended"):
            op.execute("INSERT INTO effects VALUES (%s)", ("k1",))
        with pytest.raises(UsageError, match="runs once"), op:
            pass
        c.commit()
        with store.once(c, "tenant", "k1", FP, commit=commit) as again:
            assert again.won
            again.execute("INSERT INTO effects VALUES (%s)", ("k1",))
            again.respond(RESPONSE)
        c.commit()
    assert op.response == Response(503)
    assert effects(dsn, "k1") == 1


async def test_async_an_operation_block_runs_once(dsn: str, astore: AsyncKeyStore) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as c:
        op = astore.once(c, "tenant", "k1", FP)
        async with op:
            op.respond(Response(503))
        with pytest.raises(UsageError, match="block has ended"):
            op.respond(RESPONSE)
        with pytest.raises(UsageError, match="runs once"):
            async with op:
                pass
