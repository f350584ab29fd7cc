"""``@idempotent`` on real PostgreSQL: replay, mismatch, in flight, rollback, sync and async.

Effects are counted in the database: a ``charges`` row is the function really running, and the
keys table is what the next call will see.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce import (
    AsyncKeyStore,
    KeyInFlight,
    KeyMismatch,
    KeyStore,
    NotInTransaction,
    UsageError,
    fingerprint,
    idempotent,
)

SHORT = timedelta(milliseconds=100)


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for the test's own reads; it creates the business table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE charges (order_id text NOT NULL, amount int NOT NULL)")
        yield conn


def charges(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM charges").fetchone()
    assert row is not None
    return int(row[0])


def keys(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    assert row is not None
    return int(row[0])


runs: list[str] = []


@idempotent(key="order_id", scope="charges")
def charge(conn: psycopg.Connection[Any], order_id: str, amount: int) -> dict[str, Any]:
    runs.append(order_id)
    conn.execute("INSERT INTO charges VALUES (%s, %s)", (order_id, amount))
    return {"order": order_id, "amount": amount, "tags": ("a", "b")}


@idempotent(key="order_id", scope="charges", commit=True)
async def charge_async(
    conn: psycopg.AsyncConnection[Any], order_id: str, amount: int
) -> dict[str, Any]:
    runs.append(order_id)
    await conn.execute("INSERT INTO charges VALUES (%s, %s)", (order_id, amount))
    return {"order": order_id, "amount": amount}


@pytest.fixture(autouse=True)
def _no_runs() -> None:
    runs.clear()


def test_a_second_call_replays_the_stored_result_and_runs_nothing(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn) as conn:  # the caller's transaction, committed at the block's end
        first = charge(conn, "o-1", 1000)
    with psycopg.connect(dsn) as conn:
        second = charge(conn, order_id="o-1", amount=1000)
    assert runs == ["o-1"]
    # Both through JSON: the call that ran returns what every replay will.
    assert first == second == {"order": "o-1", "amount": 1000, "tags": ["a", "b"]}
    assert charges(db) == 1
    row = db.execute("SELECT scope, key, response_body FROM pgonce.keys").fetchone()
    assert row is not None
    assert row[:2] == ("charges", "o-1")
    assert bytes(row[2]) == b'{"order":"o-1","amount":1000,"tags":["a","b"]}'


async def test_a_coroutine_function_replays_and_commits_on_its_own(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        first = await charge_async(conn, "o-2", 5)
        assert charges(db) == 1  # commit=True: committed when the call returned
        second = await charge_async(conn, "o-2", 5)
    assert first == second == {"order": "o-2", "amount": 5}
    assert runs == ["o-2"]
    assert keys(db) == 1


def test_the_same_key_with_other_arguments_is_a_mismatch(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn) as conn:
        charge(conn, "o-3", 1000)
    with psycopg.connect(dsn) as conn, pytest.raises(KeyMismatch):
        charge(conn, "o-3", 999)
    assert runs == ["o-3"]
    assert charges(db) == 1


def test_a_call_while_another_holds_the_key_is_in_flight(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    holding = threading.Event()
    release = threading.Event()

    @idempotent(key="order_id", scope="charges", commit=True, wait=SHORT)
    def slow(conn: psycopg.Connection[Any], order_id: str) -> int:
        conn.execute("INSERT INTO charges VALUES (%s, 1)", (order_id,))
        holding.set()
        assert release.wait(30)
        return 1

    def original() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            slow(conn, "o-4")

    thread = threading.Thread(target=original)
    thread.start()
    try:
        assert holding.wait(30)
        with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(KeyInFlight) as caught:
            slow(conn, "o-4")
        assert caught.value.retry_after >= 1
        assert caught.value.key == "o-4"
        assert charges(db) == 0  # nothing ran for the duplicate, the original not committed
    finally:
        release.set()
        thread.join(30)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert slow(conn, "o-4") == 1  # now a replay
    assert charges(db) == 1


def test_an_exception_rolls_back_the_writes_and_frees_the_key(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    attempts: list[int] = []

    @idempotent(key="order_id", commit=True)
    def flaky(conn: psycopg.Connection[Any], order_id: str) -> str:
        conn.execute("INSERT INTO charges VALUES (%s, 1)", (order_id,))
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("the payment provider timed out")
        return "charged"

    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(RuntimeError):
            flaky(conn, "o-5")
        assert charges(db) == 0
        assert keys(db) == 0
        assert flaky(conn, "o-5") == "charged"  # the retry runs again
        assert flaky(conn, "o-5") == "charged"  # and is then replayed
    assert len(attempts) == 2
    assert charges(db) == 1


def test_commit_true_refuses_a_connection_inside_a_transaction(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    @idempotent(key="order_id", commit=True)
    def committing(conn: psycopg.Connection[Any], order_id: str) -> str:
        conn.execute("INSERT INTO charges VALUES (%s, 1)", (order_id,))
        return "charged"

    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")  # the caller's transaction is open
        with pytest.raises(UsageError, match="without commit=True"):
            committing(conn, "o-13")
        conn.rollback()
        assert committing(conn, "o-13") == "charged"  # idle again: it runs and commits
    assert charges(db) == 1
    assert keys(db) == 1


def test_the_call_joins_the_callers_transaction_and_rolls_back_with_it(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn) as conn:
        charge(conn, "o-6", 1)
        conn.execute("INSERT INTO charges VALUES ('caller', 1)")
        conn.rollback()  # the caller's decision: the claim, the charge and its own row go
    assert charges(db) == 0
    assert keys(db) == 0
    with psycopg.connect(dsn) as conn:
        charge(conn, "o-6", 1)
    assert runs == ["o-6", "o-6"]
    assert charges(db) == 1


def test_an_exception_inside_the_callers_transaction_keeps_the_callers_work(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    @idempotent(key="order_id")
    def refuse(conn: psycopg.Connection[Any], order_id: str) -> None:
        conn.execute("INSERT INTO charges VALUES (%s, 1)", (order_id,))
        raise ValueError("refused")

    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO charges VALUES ('caller', 1)")
        with pytest.raises(ValueError, match="refused"):
            refuse(conn, "o-7")
    # The savepoint rolled back the function's row and the claim; the caller's row committed.
    assert [r[0] for r in db.execute("SELECT order_id FROM charges")] == ["caller"]
    assert keys(db) == 0


def test_a_key_function_a_custom_codec_and_a_payload_argument(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    @dataclasses.dataclass(frozen=True)
    class Receipt:
        order: str
        cents: int

    class ReceiptCodec:
        content_type = "text/plain"

        def encode(self, value: Receipt) -> bytes:
            return f"{value.order}|{value.cents}".encode()

        def decode(self, data: bytes) -> Receipt:
            order, cents = data.decode().split("|")
            return Receipt(order, int(cents))

    @idempotent(
        key=lambda conn, message, attempt: message["id"],
        payload="message",  # the delivery attempt is not part of what makes two calls the same
        codec=ReceiptCodec(),
        commit=True,
    )
    def handle(conn: psycopg.Connection[Any], message: dict[str, Any], attempt: int) -> Receipt:
        conn.execute("INSERT INTO charges VALUES (%s, %s)", (message["id"], message["cents"]))
        return Receipt(message["id"], message["cents"])

    message = {"id": "m-1", "cents": 250}
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert handle(conn, message, 1) == Receipt("m-1", 250)
        assert handle(conn, message, 2) == Receipt("m-1", 250)  # redelivered: a replay
        with pytest.raises(KeyMismatch):
            handle(conn, {"id": "m-1", "cents": 1}, 3)
    assert charges(db) == 1


def test_a_structured_key_is_hashed_like_a_payload(dsn: str, db: psycopg.Connection[Any]) -> None:
    @idempotent(key="event", commit=True)
    def on_event(conn: psycopg.Connection[Any], event: dict[str, Any]) -> int:
        conn.execute("INSERT INTO charges VALUES ('e', 1)")
        return 1

    with psycopg.connect(dsn, autocommit=True) as conn:
        on_event(conn, {"b": 2, "a": [1, b"\x00"]})
        on_event(conn, {"a": [1, b"\x00"], "b": 2})  # the same event, keys in another order
    assert charges(db) == 1
    row = db.execute("SELECT key FROM pgonce.keys").fetchone()
    assert row is not None
    assert row[0].startswith("sha256:")


# --- misuse: a clear error at the decoration, or at the call, before anything commits --------


def test_names_that_are_no_parameter_are_refused_when_decorating() -> None:
    def f(conn: psycopg.Connection[Any], order_id: str) -> None: ...

    with pytest.raises(UsageError, match=r"key='order'\) names no parameter"):
        idempotent(key="order")(f)
    with pytest.raises(UsageError, match="connection='db'"):
        idempotent(key="order_id", connection="db")(f)
    with pytest.raises(UsageError, match="needs an AsyncKeyStore"):

        @idempotent(key="order_id", store=KeyStore())
        async def g(conn: psycopg.AsyncConnection[Any], order_id: str) -> None: ...

    with pytest.raises(UsageError, match="needs a KeyStore"):
        idempotent(key="order_id", store=AsyncKeyStore())(f)
    with pytest.raises(UsageError, match="key must"):
        idempotent(key=42)  # type: ignore[arg-type]


def test_an_autocommit_connection_without_commit_true_is_refused(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(NotInTransaction):
        charge(conn, "o-8", 1)
    assert runs == []


def test_a_result_that_is_not_json_is_refused_and_nothing_commits(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    @idempotent(key="order_id", commit=True)
    def opaque(conn: psycopg.Connection[Any], order_id: str) -> object:
        conn.execute("INSERT INTO charges VALUES (%s, 1)", (order_id,))
        return object()

    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(UsageError, match="codec"):
        opaque(conn, "o-9")
    assert charges(db) == 0
    assert keys(db) == 0


def test_an_argument_without_a_json_form_is_refused_before_the_claim(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    @idempotent(key="order_id", commit=True)
    def with_lock(conn: psycopg.Connection[Any], order_id: str, lock: Any) -> None: ...

    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(UsageError, match="payload"):
        with_lock(conn, "o-10", threading.Lock())
    assert keys(db) == 0


def test_values_that_contain_themselves_are_refused(dsn: str, db: psycopg.Connection[Any]) -> None:
    # The encoders are made once and keep no record of the containers they met: a value that
    # contains itself is refused by the depth it reaches, as a UsageError all the same.
    loop: list[Any] = []
    loop.append(loop)

    @idempotent(key="order_id", commit=True)
    def looping(conn: psycopg.Connection[Any], order_id: str, extra: Any = None) -> object:
        conn.execute("INSERT INTO charges VALUES (%s, 1)", (order_id,))
        return loop

    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(UsageError, match="payload"):
            looping(conn, "o-12", loop)
        with pytest.raises(UsageError, match="codec"):
            looping(conn, "o-12")
    assert charges(db) == 0
    assert keys(db) == 0


def test_the_fingerprint_is_the_key_stores_own(dsn: str, db: psycopg.Connection[Any]) -> None:
    # A claim made by the decorator is an ordinary key-store row: the same scope, key and
    # fingerprint through the store directly replays it.
    with psycopg.connect(dsn) as conn:
        charge(conn, "o-11", 7)
    expected = fingerprint(b'{"amount":7,"order_id":"o-11"}')
    with psycopg.connect(dsn) as conn, KeyStore().once(conn, "charges", "o-11", expected) as op:
        assert op.replayed


def test_a_default_given_or_left_out_and_any_call_shape_is_the_same_call(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    ran: list[int] = []

    @idempotent(key="order_id", connection="db", commit=True)
    def pay(order_id: str, db: psycopg.Connection[Any], amount: int = 5, *, note: str = "") -> int:
        ran.append(amount)
        return amount

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert pay("o-12", conn) == 5
        assert pay("o-12", conn, 5) == 5
        assert pay(order_id="o-12", db=conn, amount=5, note="") == 5
        assert pay("o-12", amount=5, db=conn) == 5
        with pytest.raises(KeyMismatch):
            pay("o-12", conn, note="other")
        with pytest.raises(TypeError):
            pay("o-12", conn, 5, db=conn)  # type: ignore[misc]
    assert ran == [5]


def test_every_argument_by_position_is_the_same_call_as_by_name(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    # A call that gives every parameter by position is read without merging or binding: the
    # connection where it stands (not first here), every other argument in the fingerprint.
    ran: list[int] = []

    @idempotent(key=lambda order_id, db, amount: order_id, connection="db", commit=True)
    def pay(order_id: str, db: psycopg.Connection[Any], amount: int) -> int:
        ran.append(amount)
        return amount

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert pay("o-13", conn, 5) == 5
        assert pay(amount=5, db=conn, order_id="o-13") == 5
        with pytest.raises(KeyMismatch):
            pay("o-13", conn, 6)
    assert ran == [5]
    expected = fingerprint(b'{"amount":5,"order_id":"o-13"}')
    scope = f"{pay.__module__}.{pay.__qualname__}"
    with psycopg.connect(dsn) as conn, KeyStore().once(conn, scope, "o-13", expected) as op:
        assert op.replayed


def test_in_flight_inside_the_callers_transaction_leaves_it_usable(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    @idempotent(key="order_id", scope="charges", wait=SHORT)
    def joined(conn: psycopg.Connection[Any], order_id: str) -> int:
        conn.execute("INSERT INTO charges VALUES (%s, 1)", (order_id,))
        return 1

    with psycopg.connect(dsn) as holder:
        assert joined(holder, "o-13") == 1  # claimed, not committed: the key is held
        with psycopg.connect(dsn) as conn:
            conn.execute("INSERT INTO charges VALUES ('caller', 1)")
            with pytest.raises(KeyInFlight):
                joined(conn, "o-13")
            conn.execute("INSERT INTO charges VALUES ('caller', 2)")  # still usable
        holder.rollback()
    assert sorted(r[0] for r in db.execute("SELECT order_id FROM charges")) == ["caller"] * 2
