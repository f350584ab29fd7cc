"""``@idempotent`` at its edges: results JSON rewrites, keys that are None, generator functions,
and options the key store would refuse at every call, on real PostgreSQL."""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import multiprocessing
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce import UsageError, idempotent


class Color(enum.IntEnum):
    RED = 1


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (k text)")
        yield conn


def count(db: psycopg.Connection[Any], table: str) -> int:
    row = db.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("result", "stored"),
    [
        ({1: "a", None: "b", 2.5: "c"}, {"1": "a", "null": "b", "2.5": "c"}),
        ((1, (2, 3)), [1, [2, 3]]),
        ({"color": Color.RED}, {"color": 1}),
    ],
    ids=["dict-keys", "tuples", "int-enum"],
)
@pytest.mark.parametrize("commit", [False, True])
def test_the_call_that_ran_returns_what_a_replay_returns(
    dsn: str, db: psycopg.Connection[Any], result: Any, stored: Any, commit: bool
) -> None:
    # JSON rewrites these silently; a first call answering {1: ...} and its replay {"1": ...}
    # would be one operation answering two ways.
    @idempotent(key="k", commit=commit)
    def run(conn: psycopg.Connection[Any], k: str) -> object:
        conn.execute("INSERT INTO effects VALUES (%s)", (k,))
        return result

    answers: list[Any] = []
    for _ in range(2):
        with psycopg.connect(dsn, autocommit=commit) as conn:
            answers.append(run(conn, "r"))
    assert answers[0] == answers[1] == stored
    assert [type(a) for a in answers[0]] == [type(a) for a in answers[1]]
    assert count(db, "effects") == 1


async def test_a_coroutine_function_returns_what_a_replay_returns(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    @idempotent(key="k")
    async def run(conn: psycopg.AsyncConnection[Any], k: str) -> object:
        await conn.execute("INSERT INTO effects VALUES (%s)", (k,))
        return {7: (1, 2)}

    answers: list[Any] = []
    for _ in range(2):
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            answers.append(await run(conn, "a"))
    assert answers == [{"7": [1, 2]}, {"7": [1, 2]}]
    assert count(db, "effects") == 1


def test_a_codec_that_cannot_read_back_its_result_stores_nothing(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    class WriteOnly:
        content_type = "text/plain"

        def encode(self, value: str) -> bytes:
            return value.encode()

        def decode(self, data: bytes) -> str:
            raise ValueError("cannot read it back")

    @idempotent(key="k", codec=WriteOnly())
    def run(conn: psycopg.Connection[Any], k: str) -> str:
        conn.execute("INSERT INTO effects VALUES (%s)", (k,))
        return "done"

    with psycopg.connect(dsn) as conn, pytest.raises(ValueError, match="read it back"):
        run(conn, "w")
    assert count(db, "effects") == 0
    assert count(db, "pgonce.keys") == 0


def test_a_key_that_is_none_is_refused_before_the_claim(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    # Hashed like any value, every call without a key would share one: the second
    # "send(None, 'hi')" would replay the first, a second message silently never sent.
    @idempotent(key="message_id")
    def send(conn: psycopg.Connection[Any], message_id: str | None, body: str) -> None:
        conn.execute("INSERT INTO effects VALUES (%s)", (body,))

    @idempotent(key=lambda conn, message_id, body: message_id)
    def send_by_function(conn: psycopg.Connection[Any], message_id: str | None, body: str) -> None:
        conn.execute("INSERT INTO effects VALUES (%s)", (body,))

    for function in (send, send_by_function):
        with psycopg.connect(dsn) as conn, pytest.raises(UsageError, match="None"):
            function(conn, None, "hi")
    assert count(db, "effects") == 0
    assert count(db, "pgonce.keys") == 0


def test_generator_functions_are_refused_when_decorating() -> None:
    def numbers(conn: psycopg.Connection[Any], k: str) -> Iterator[int]:
        yield 1

    async def numbers_async(conn: psycopg.AsyncConnection[Any], k: str) -> AsyncIterator[int]:
        yield 1

    for function in (numbers, numbers_async):
        with pytest.raises(UsageError, match="generator"):
            idempotent(key="k")(function)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"wait": 5}, "timedelta"),
        ({"wait": timedelta(milliseconds=1)}, "at least"),
        ({"scope": "a\x00b"}, "NUL"),
        ({"scope": "s" * 600}, "bytes long"),
    ],
    ids=["wait-int", "wait-short", "scope-nul", "scope-long"],
)
def test_options_the_key_store_would_refuse_are_refused_when_decorating(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(UsageError, match=match):

        @idempotent(key="k", **options)
        def run(conn: psycopg.Connection[Any], k: str) -> None: ...


def test_callables_without_a_name_need_a_scope_and_async_ones_are_awaited(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    # A callable object or a partial has no __qualname__: an AttributeError when decorating,
    # where a UsageError that says what to give belongs.
    class Charge:
        async def __call__(self, conn: psycopg.AsyncConnection[Any], k: str) -> int:
            await conn.execute("INSERT INTO effects VALUES (%s)", (k,))
            return 1

    async def plain(conn: psycopg.AsyncConnection[Any], k: str) -> int:
        return 2

    for nameless in (Charge(), functools.partial(plain)):
        with pytest.raises(UsageError, match="scope="):
            idempotent(key="k")(nameless)

    # Given a scope, an object whose __call__ is a coroutine function is run as one (it was
    # run as a plain function, its coroutine never awaited).
    charge = idempotent(key="k", scope="charge-object")(Charge())
    assert inspect.iscoroutinefunction(charge)

    async def twice() -> list[int]:
        answers = []
        for _ in range(2):
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                answers.append(await charge(conn, "c"))
        return answers

    assert asyncio.run(twice()) == [1, 1]
    assert count(db, "effects") == 1


def test_a_static_or_class_method_object_is_refused_with_the_order_to_use() -> None:
    def function(conn: psycopg.Connection[Any], k: str) -> None: ...

    loose: Any = function
    wrappers: list[Any] = [staticmethod(loose), classmethod(loose)]
    for wrapped in wrappers:
        with pytest.raises(UsageError, match="below @staticmethod"):
            idempotent(key="k")(wrapped)


@pytest.mark.parametrize("content_type", ["text/plain\x00", "text/plain\r\nX-Evil: 1", 5])
def test_a_codec_content_type_the_store_cannot_hold_is_refused_when_decorating(
    content_type: object,
) -> None:
    # A NUL failed the completion at the first call, after the function had run.
    class Codec:
        def encode(self, value: object) -> bytes:
            return b"x"

        def decode(self, data: bytes) -> str:
            return "x"

    codec: Any = Codec()
    codec.content_type = content_type
    with pytest.raises(UsageError, match="content_type"):
        idempotent(key="k", codec=codec)


@idempotent(key="k", scope="across-processes", commit=True, wait=timedelta(seconds=20))
def _charge_once(conn: psycopg.Connection[Any], k: str, amount: int) -> dict[str, int]:
    conn.execute("INSERT INTO effects VALUES (%s)", (k,))
    return {"amount": amount}


def _charge_in_a_process(dsn: str, start: Any) -> object:
    with psycopg.connect(dsn, autocommit=True) as conn:
        start.wait()
        return _charge_once(conn, "one", 5)


def test_one_key_called_from_many_processes_runs_once(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(4) as pool:
        start = manager.Event()
        pending = [pool.apply_async(_charge_in_a_process, (dsn, start)) for _ in range(4)]
        start.set()
        answers = [p.get(timeout=60) for p in pending]
    assert answers == [{"amount": 5}] * 4
    assert count(db, "effects") == 1
