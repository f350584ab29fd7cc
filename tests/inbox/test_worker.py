"""Inbox workers on real PostgreSQL: exactly-once effects, retries, dead letters, ordering,
watermarks, wake-ups, shutdown and HTTP forwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pgonce.core.inbox import Delivery, InboxEvent, Ordering, RetryPolicy, digest
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.webhooks.forward import forward_to
from pgonce.webhooks.source import Source
from pgonce.webhooks.worker import BatchResult, InboxWorker
from tests.inbox.conftest import (
    SCHEMA,
    effects,
    eventually,
    record_effect,
    serve,
    source,
    statuses,
)

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
AHandler = Callable[[InboxEvent, psycopg.AsyncConnection[Any]], Awaitable[None]]


def delivery(
    event_id: str, payload: dict[str, Any], *, name: str = "shop", ordering: Ordering | None = None
) -> Delivery:
    body = json.dumps(payload).encode()
    return Delivery(
        name, event_id, body, {"content-type": "application/json"}, digest(body), ordering
    )


async def deliver(
    dsn: str, *deliveries: Delivery, one_by_one: bool = False, now: Any = None
) -> None:
    """Store deliveries as the receiver would: one transaction (or one each, in arrival order)."""
    store = AsyncInboxStore(schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        groups = [[d] for d in deliveries] if one_by_one else [list(deliveries)]
        for group in groups:
            async with conn.transaction():
                assert set(await store.store(conn, group, now=now)) == {"stored"}


async def row(dsn: str, event_id: str, name: str = "shop") -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        found = await AsyncInboxStore(schema=SCHEMA).get(conn, name, event_id)
    assert found is not None
    return found


async def run_batches(worker: InboxWorker, dsn: str, **kwargs: Any) -> list[Any]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        results = []
        while True:
            result = await worker.run_once(conn, **kwargs)
            results.append(result)
            if result.claimed == 0:
                return results


@pytest.mark.pooled
async def test_handler_effects_commit_with_done(effects_dsn: str) -> None:
    await deliver(effects_dsn, *(delivery(f"e{i}", {"n": i}) for i in range(10)))
    seen: list[Any] = []

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        seen.append(event.payload)
        await record_effect(event, conn)

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA, batch_size=4)
    results = await run_batches(worker, effects_dsn)
    assert [r.claimed for r in results] == [4, 4, 2, 0]
    assert len(effects(effects_dsn)) == 10
    assert sorted(p["n"] for p in seen) == list(range(10))
    assert set(statuses(effects_dsn).values()) == {"done"}
    done = await row(effects_dsn, "e0")
    assert done["attempts"] == 0  # failed runs only
    assert done["processed_at"] is not None


async def test_retries_back_off_then_dead_letter_then_replay(effects_dsn: str) -> None:
    await deliver(effects_dsn, delivery("e1", {"n": 1}), now=T0)
    broken = True

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)  # must be rolled back with the failure
        if broken:
            raise RuntimeError("the ledger is down")

    policy = RetryPolicy(attempts=3, base=timedelta(seconds=10), cap=timedelta(seconds=15))
    worker = InboxWorker([source(handler=handler, retry=policy)], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        first = await worker.run_once(conn, now=T0, jitter=0.5)
        assert (first.claimed, first.retried) == (1, 1)
        after_one = await row(effects_dsn, "e1")
        assert after_one["status"] == "pending"
        assert after_one["attempts"] == 1
        assert after_one["next_attempt_at"] == T0 + timedelta(seconds=7.5)  # 5 + 5 * 0.5
        assert after_one["last_error"] == "RuntimeError: the ledger is down"

        assert (await worker.run_once(conn, now=T0 + timedelta(seconds=7))).claimed == 0
        second = await worker.run_once(conn, now=T0 + timedelta(seconds=8), jitter=0.0)
        assert second.retried == 1
        after_two = await row(effects_dsn, "e1")
        # 10 s doubled is 20 s, capped at 15 s; equal jitter 0 gives half of it.
        assert after_two["next_attempt_at"] == T0 + timedelta(seconds=8 + 7.5)

        third = await worker.run_once(conn, now=T0 + timedelta(seconds=16))
        assert third.dead == 1
        dead = await row(effects_dsn, "e1")
        assert (dead["status"], dead["attempts"]) == ("dead", 3)
        assert dead["processed_at"] is not None
        assert (await worker.run_once(conn, now=T0 + timedelta(days=1))).claimed == 0
        assert effects(effects_dsn) == []

        broken = False
        assert await worker.replay(conn, "shop", now=T0 + timedelta(seconds=20)) == ["e1"]
        assert await worker.replay(conn, "shop") == []  # nothing dead any more
        replayed = await worker.run_once(conn, now=T0 + timedelta(seconds=20))
        assert replayed.done == 1
    assert len(effects(effects_dsn)) == 1
    assert (await row(effects_dsn, "e1"))["status"] == "done"


async def test_a_failing_handler_commits_nothing_and_the_rest_of_its_batch_commits_once(
    effects_dsn: str,
) -> None:
    await deliver(effects_dsn, *(delivery(f"e{i}", {"n": i}) for i in range(5)), now=T0)
    runs: list[str] = []

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        runs.append(event.id)
        await record_effect(event, conn)
        if event.id == "e2":
            # An SQL error aborts the transaction: the batch (or its savepoint) must recover.
            await conn.execute("SELECT 1 / 0")
        if event.id == "e3":
            # A handler that swallows a database error must not pass for a success.
            with contextlib.suppress(psycopg.Error):
                await conn.execute("SELECT 1 / 0")

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        # Without savepoints the first failure rolls the whole batch back...
        first = await worker.run_once(conn, now=T0)
        assert (first.claimed, first.done, first.retried) == (5, 0, 1)
        assert runs == ["e0", "e1", "e2"]
        # ...and the next batches isolate each handler, so e3's failure costs only itself.
        second = await worker.run_once(conn, now=T0)
        assert (second.claimed, second.done, second.retried) == (4, 3, 1)
        assert (await worker.run_once(conn, now=T0)).claimed == 0
    assert sorted(e for _, e, _ in effects(effects_dsn)) == ["e0", "e1", "e4"]
    assert statuses(effects_dsn) == {
        "e0": "done",
        "e1": "done",
        "e2": "pending",
        "e3": "pending",
        "e4": "done",
    }
    assert "division by zero" in (await row(effects_dsn, "e2"))["last_error"]
    assert (await row(effects_dsn, "e3"))["last_error"].startswith("HandlerSwallowedError")


async def test_handler_timeout_counts_as_a_failure(effects_dsn: str) -> None:
    await deliver(effects_dsn, delivery("slow", {}))

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)
        await asyncio.sleep(30)

    worker = InboxWorker(
        [source(handler=handler, handler_timeout=timedelta(milliseconds=100))],
        dsn=effects_dsn,
        schema=SCHEMA,
    )
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        assert (await worker.run_once(conn)).retried == 1
    assert effects(effects_dsn) == []
    assert (await row(effects_dsn, "slow"))["last_error"].startswith("HandlerTimeout")


def by_key(payload: Any, headers: Any) -> Ordering:
    return Ordering(payload["key"], payload.get("version"))


async def test_ordering_under_concurrency(effects_dsn: str) -> None:
    keys = [f"obj_{k}" for k in range(5)]
    arrivals = [
        delivery(f"{key}-{n}", {"key": key, "n": n}, ordering=Ordering(key))
        for n in range(12)
        for key in keys
    ]
    await deliver(effects_dsn, *arrivals, one_by_one=True)
    running: set[str] = set()
    overlaps: list[str] = []
    failed_once: set[str] = set()

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        key = event.ordering_key
        assert key is not None
        if key in running:
            overlaps.append(event.id)
        running.add(key)
        try:
            await record_effect(event, conn)
            await asyncio.sleep(0.002)
            # Every fifth event fails once: its key must wait for its retry.
            if event.payload["n"] % 5 == 2 and event.id not in failed_once:
                failed_once.add(event.id)
                raise RuntimeError("transient")
        finally:
            running.discard(key)

    fast_retry = RetryPolicy(base=timedelta(milliseconds=20), cap=timedelta(milliseconds=40))
    worker = InboxWorker(
        [source(handler=handler, ordering=by_key, retry=fast_retry)],
        dsn=effects_dsn,
        schema=SCHEMA,
        concurrency=4,
        batch_size=3,
        poll_interval=timedelta(milliseconds=20),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await eventually(lambda: set(statuses(effects_dsn).values()) == {"done"})
    stop.set()
    await task
    assert overlaps == []
    done = effects(effects_dsn)
    assert len(done) == len(arrivals)
    for key in keys:
        order = [int(e.split("-")[1]) for _, e, k in done if k == key]
        assert order == list(range(12)), key
    assert len(failed_once) == 10


@pytest.mark.parametrize("policy", ["block", "park"])
async def test_a_dead_head_blocks_or_parks_its_key(effects_dsn: str, policy: str) -> None:
    await deliver(
        effects_dsn,
        delivery("a1", {"key": "A"}, ordering=Ordering("A")),
        delivery("a2", {"key": "A"}, ordering=Ordering("A")),
        delivery("b1", {"key": "B"}, ordering=Ordering("B")),
        one_by_one=True,
        now=T0,
    )
    poison = {"a1"}

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        if event.id in poison:
            raise ValueError("poison")
        await record_effect(event, conn)

    worker = InboxWorker(
        [source(handler=handler, head_failure=policy, retry=RetryPolicy(attempts=1))],
        dsn=effects_dsn,
        schema=SCHEMA,
    )
    await run_batches(worker, effects_dsn, now=T0)
    if policy == "block":
        assert statuses(effects_dsn) == {"a1": "dead", "a2": "pending", "b1": "done"}
        poison.clear()
        async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
            await worker.replay(conn, "shop", ["a1"], now=T0)
        await run_batches(worker, effects_dsn, now=T0)
        assert [e for _, e, _ in effects(effects_dsn)] == ["b1", "a1", "a2"]
    else:
        assert statuses(effects_dsn) == {"a1": "dead", "a2": "done", "b1": "done"}


async def test_watermark_drops_older_versions_as_skipped(effects_dsn: str) -> None:
    fail_v5 = True

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        if event.version == 5 and fail_v5:
            raise RuntimeError("not yet")
        await record_effect(event, conn)

    src = source(handler=handler, ordering=by_key, out_of_order="drop")
    worker = InboxWorker([src], dsn=effects_dsn, schema=SCHEMA)
    arrivals = [("v1", 1), ("v3", 3), ("v2", 2), ("v3-again", 3), ("v5", 5), ("v4", 4)]
    await deliver(
        effects_dsn,
        *(
            delivery(eid, {"key": "cus_1", "version": v}, ordering=Ordering("cus_1", v))
            for eid, v in arrivals
        ),
        one_by_one=True,
        now=T0,
    )
    await run_batches(worker, effects_dsn, now=T0)
    # v5 failed: its watermark move rolled back with it, and it blocks the key (ordering).
    assert statuses(effects_dsn) == {
        "v1": "done",
        "v3": "done",
        "v2": "skipped",
        "v3-again": "done",  # the same version is not older
        "v5": "pending",
        "v4": "pending",
    }
    fail_v5 = False
    await run_batches(worker, effects_dsn, now=T0 + timedelta(hours=1))
    assert statuses(effects_dsn)["v5"] == "done"
    assert statuses(effects_dsn)["v4"] == "skipped"
    assert [e for _, e, _ in effects(effects_dsn)] == ["v1", "v3", "v3-again", "v5"]
    assert (await row(effects_dsn, "v2"))["attempts"] == 0  # never ran
    with psycopg.connect(effects_dsn) as conn:
        mark = conn.execute(f"SELECT version, event_id FROM {SCHEMA}.inbox_watermarks").fetchall()
    assert mark == [(5, "v5")]


class WatchedWorker(InboxWorker):
    """An inbox worker that counts the looks that found nothing: after one, its loop sleeps until
    a notification or its poll interval."""

    empty_looks = 0

    async def run_once(
        self,
        conn: psycopg.AsyncConnection[Any],
        *,
        now: datetime | None = None,
        jitter: float | None = None,
    ) -> BatchResult:
        result = await super().run_once(conn, now=now, jitter=jitter)
        if not result.claimed:
            self.empty_looks += 1
        return result


def listening(dsn: str) -> bool:
    """Whether a session of this database has run LISTEN (the worker's listener is up)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query ILIKE 'LISTEN%'"
        ).fetchone()
    return row is not None and row[0] > 0


async def test_notification_wakes_an_idle_worker(effects_dsn: str) -> None:
    worker = WatchedWorker(
        [source()],
        dsn=effects_dsn,
        schema=SCHEMA,
        concurrency=1,
        poll_interval=timedelta(minutes=10),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        # Deliver once the loop has looked twice and found nothing: its first look, and the one
        # the listener's start wakes it for (set after the loop's first clear of its wake-up),
        # after which only a notification or the ten-minute poll wakes it.
        await eventually(lambda: listening(effects_dsn) and worker.empty_looks >= 2, within=10)
        await deliver(effects_dsn, delivery("e1", {}))
        await eventually(lambda: len(effects(effects_dsn)) == 1, within=5)
    finally:
        stop.set()
        await task


async def test_a_delivery_that_missed_the_registration_is_found_by_the_second_look(
    effects_dsn: str,
) -> None:
    """inbox_store() looked for waiting loops before the loop registered (so it sends no
    notification), and commits after the look that follows the registration: the loop's second
    look finds the event, not its ten-minute poll."""
    worker = WatchedWorker(
        [source()], dsn=effects_dsn, schema=SCHEMA, poll_interval=timedelta(minutes=10)
    )
    worker.settle = timedelta(seconds=3)  # room for this test to commit in between, on any machine
    store = AsyncInboxStore(schema=SCHEMA)
    stop, wake = asyncio.Event(), asyncio.Event()
    async with (
        await psycopg.AsyncConnection.connect(effects_dsn) as held,
        await psycopg.AsyncConnection.connect(effects_dsn) as conn,
    ):
        async with held.transaction():
            # Nobody waits yet: the store's check finds no registration.
            assert set(await store.store(held, [delivery("e1", {})])) == {"stored"}
            waiting = asyncio.create_task(worker._wait_for_events(conn, stop, wake, "settle-test"))
            # Registered, and looked once: the event is not committed yet.
            await eventually(lambda: worker.empty_looks >= 1, within=10)
        try:
            await eventually(lambda: len(effects(effects_dsn)) == 1, within=10)
        finally:
            stop.set()
            await waiting


async def test_polling_finds_events_without_notifications(effects_dsn: str) -> None:
    worker = WatchedWorker(
        [source()],
        dsn=effects_dsn,
        schema=SCHEMA,
        listen=False,
        poll_interval=timedelta(milliseconds=100),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        # Deliver once every loop has looked and found nothing: only its polling can find it.
        await eventually(lambda: worker.empty_looks >= worker.concurrency, within=10)
        await deliver(effects_dsn, delivery("e1", {}))
        await eventually(lambda: len(effects(effects_dsn)) == 1, within=5)
    finally:
        stop.set()
        await task


async def test_stop_lets_the_in_flight_handler_finish(effects_dsn: str) -> None:
    await deliver(effects_dsn, delivery("e1", {}), delivery("e2", {}))
    started, release = asyncio.Event(), asyncio.Event()

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        started.set()
        await release.wait()
        await record_effect(event, conn)

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA, concurrency=1)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    await asyncio.sleep(0.1)
    assert not task.done()  # waiting for the in-flight batch
    release.set()
    await asyncio.wait_for(task, 10)
    assert statuses(effects_dsn) == {"e1": "done", "e2": "done"}
    assert len(effects(effects_dsn)) == 2


@pytest.mark.parametrize("swallows", [False, True], ids=["cancelled", "swallows-the-cancel"])
async def test_stop_rolls_back_a_handler_that_outlives_the_shutdown_timeout(
    effects_dsn: str, swallows: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # A handler that catches the stop's cancellation and returns was cut at an arbitrary await
    # all the same: its writes roll back with the batch, never committed as a finished run. The
    # stop says so once, with what happens to the events (a deploy that kept cutting a slow
    # handler used to leave no trace of it).
    caplog.set_level(logging.INFO, "pgonce")
    await deliver(effects_dsn, delivery("e1", {}))
    started = asyncio.Event()

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)
        started.set()
        with contextlib.suppress(asyncio.CancelledError) if swallows else contextlib.nullcontext():
            await asyncio.sleep(3600)

    worker = InboxWorker(
        [source(handler=handler, handler_timeout=timedelta(hours=2))],
        dsn=effects_dsn,
        schema=SCHEMA,
        shutdown_timeout=timedelta(milliseconds=200),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert effects(effects_dsn) == []
    pending = await row(effects_dsn, "e1")
    assert (pending["status"], pending["attempts"]) == ("pending", 0)
    said = [r for r in caplog.records if "shutdown timeout" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert said[0].levelno == logging.WARNING
    message = said[0].getMessage()
    for words in ("1 batch", "0.2 s", "rolled back", "run again"):
        assert words in message


async def test_forward_sends_the_event_id_as_idempotency_key(dsn: str) -> None:
    received: list[tuple[str | None, str | None, bytes]] = []
    answers = [503, 200]

    async def target(request: Request) -> Response:
        received.append(
            (
                request.headers.get("idempotency-key"),
                request.headers.get("pgonce-source"),
                await request.body(),
            )
        )
        return Response(status_code=answers.pop(0))

    app = Starlette(routes=[Route("/hooks", target, methods=["POST"])])
    await deliver(dsn, delivery("evt_9", {"n": 9}), now=T0)
    with serve(app) as url:
        src = Source(name="shop", scheme=source().scheme, handler=forward_to(f"{url}/hooks"))
        worker = InboxWorker([src], dsn=dsn, schema=SCHEMA)
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            assert (await worker.run_once(conn, now=T0)).retried == 1
            assert (await row(dsn, "evt_9"))["last_error"].startswith("ForwardFailed")
            assert (await worker.run_once(conn, now=T0 + timedelta(hours=1))).done == 1
    assert received == [("evt_9", "shop", b'{"n": 9}')] * 2


async def test_a_forwards_error_shows_no_credential_of_its_url(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    await deliver(dsn, delivery("evt_9", {"n": 9}), now=T0)
    with socket.socket() as unused:  # a port nothing listens on: the connection is refused
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    url = f"http://svc:s3cr3tpass@127.0.0.1:{port}/hooks?token=tok_LIVE_123"
    src = Source(name="shop", scheme=source().scheme, handler=forward_to(url))
    worker = InboxWorker([src], dsn=dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        assert (await worker.run_once(conn, now=T0)).retried == 1
    error = (await row(dsn, "evt_9"))["last_error"]
    assert error.startswith(f"ForwardFailed: forwarding to http://127.0.0.1:{port} failed: ")
    for secret in ("s3cr3tpass", "tok_LIVE_123", "/hooks"):
        assert secret not in error
        assert secret not in caplog.text


async def test_a_handler_error_with_a_nul_or_a_lone_surrogate_is_recorded(
    effects_dsn: str,
) -> None:
    """An error's message carries what the payload held: a failure the database could not store
    would roll the batch back for ever, its other events with it."""
    await deliver(effects_dsn, delivery("evil", {"status": "\u0000"}), delivery("ok", {}), now=T0)

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        if event.id == "evil":
            raise ValueError(f"unknown status {event.payload['status']!s} \udc80")
        await record_effect(event, conn)

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    await run_batches(worker, effects_dsn, now=T0)
    assert statuses(effects_dsn) == {"evil": "pending", "ok": "done"}
    failed = await row(effects_dsn, "evil")
    assert (failed["attempts"], failed["last_error"]) == (1, "ValueError: unknown status ? ?")


async def test_a_handler_that_commits_the_batch_loses_no_event(
    effects_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A COMMIT in SQL commits the claim's done marks of the whole batch, the events whose
    handlers have not run yet included: those are set back to pending, and the committing
    handler's event is dead-lettered for someone to look at, not run again."""
    await deliver(effects_dsn, *(delivery(f"e{i}", {"n": i}) for i in range(4)), now=T0)

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)
        if event.id == "e1":
            await conn.execute("COMMIT")

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    with caplog.at_level(logging.ERROR, logger="pgonce.inbox"):
        results = await run_batches(worker, effects_dsn, now=T0)
    assert (results[0].claimed, results[0].done, results[0].dead) == (4, 1, 1)
    assert sorted(e for _, e, _ in effects(effects_dsn)) == ["e0", "e1", "e2", "e3"]
    assert statuses(effects_dsn) == {"e0": "done", "e1": "dead", "e2": "done", "e3": "done"}
    assert (await row(effects_dsn, "e1"))["last_error"].startswith("HandlerEndedTransaction")
    assert "ran COMMIT on the worker's transaction" in caplog.text
    assert "the 2 after it are pending again" in caplog.text


@pytest.mark.parametrize("then_raise", [False, True])
async def test_a_handler_that_rolls_the_batch_back_is_retried(
    effects_dsn: str, then_raise: bool
) -> None:
    await deliver(effects_dsn, *(delivery(f"e{i}", {"n": i}) for i in range(3)), now=T0)
    rolled_back = False

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        nonlocal rolled_back
        await record_effect(event, conn)
        if event.id == "e1" and not rolled_back:
            rolled_back = True
            await conn.execute("ROLLBACK")
            if then_raise:
                raise RuntimeError("the handler's own error")

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        first = await worker.run_once(conn, now=T0)
    assert (first.claimed, first.done, first.retried) == (3, 0, 1)
    assert effects(effects_dsn) == []
    error = (await row(effects_dsn, "e1"))["last_error"]
    assert error.startswith("HandlerEndedTransaction")
    assert ("the handler's own error" in error) == then_raise
    await run_batches(worker, effects_dsn, now=T0 + timedelta(hours=1))
    assert sorted(e for _, e, _ in effects(effects_dsn)) == ["e0", "e1", "e2"]
    assert set(statuses(effects_dsn).values()) == {"done"}


async def test_a_handler_raising_cancelled_error_fails_its_event_not_the_worker(
    effects_dsn: str,
) -> None:
    await deliver(effects_dsn, delivery("poison", {}), delivery("ok", {}), now=T0)

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        if event.id == "poison":
            waited = asyncio.get_running_loop().create_future()
            waited.cancel()  # a call the handler awaited was cancelled elsewhere
            await waited
        await record_effect(event, conn)

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    await run_batches(worker, effects_dsn, now=T0)
    assert statuses(effects_dsn) == {"poison": "pending", "ok": "done"}
    failed = await row(effects_dsn, "poison")
    assert (failed["attempts"], failed["last_error"].split(":")[0]) == (1, "HandlerCancelled")


async def test_handlers_by_event_type(effects_dsn: str) -> None:
    await deliver(
        effects_dsn,
        delivery("paid", {"type": "invoice.paid"}),
        delivery("other", {"type": "customer.created"}),
        delivery("untyped", {}),
    )
    ran: list[tuple[str, str]] = []

    async def on_paid(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        ran.append(("paid", event.id))
        await record_effect(event, conn)

    src = source(
        handler=None,
        handlers={"invoice.paid": on_paid},
        event_type=lambda payload, headers: payload.get("type"),
    )
    worker = InboxWorker([src], dsn=effects_dsn, schema=SCHEMA)
    await run_batches(worker, effects_dsn)
    assert ran == [("paid", "paid")]
    assert statuses(effects_dsn) == {"paid": "done", "other": "done", "untyped": "done"}


async def test_a_write_that_breaks_a_deferred_constraint_at_commit_fails_alone(
    effects_dsn: str,
) -> None:
    with psycopg.connect(effects_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE ledger (id int, CONSTRAINT ledger_once UNIQUE (id)"
            " DEFERRABLE INITIALLY DEFERRED)"
        )
    await deliver(effects_dsn, *(delivery(f"e{i}", {"n": i}) for i in range(5)), now=T0)

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)
        # e3 writes the same ledger id twice: only COMMIT finds out.
        copies = 2 if event.id == "e3" else 1
        for _ in range(copies):
            await conn.execute("INSERT INTO ledger VALUES (%s)", (event.payload["n"],))

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    results = await run_batches(worker, effects_dsn, now=T0)
    assert sum(r.retried for r in results) == 1
    assert statuses(effects_dsn) == {
        "e0": "done",
        "e1": "done",
        "e2": "done",
        "e3": "pending",
        "e4": "done",
    }
    assert sorted(e for _, e, _ in effects(effects_dsn)) == ["e0", "e1", "e2", "e4"]
    failed = await row(effects_dsn, "e3")
    assert failed["attempts"] == 1
    assert failed["last_error"].startswith("UniqueViolation")


async def test_a_worker_takes_turns_between_its_sources(effects_dsn: str) -> None:
    await deliver(effects_dsn, *(delivery(f"a{i}", {}, name="a") for i in range(30)), now=T0)
    await deliver(effects_dsn, *(delivery(f"b{i}", {}, name="b") for i in range(30)), now=T0)
    # A receive-only source's backlog must not stand in the way of the others' claims.
    await deliver(effects_dsn, *(delivery(f"c{i}", {}, name="c") for i in range(300)), now=T0)
    worker = InboxWorker(
        [source("a"), source("b"), source("c", handler=None)],
        dsn=effects_dsn,
        schema=SCHEMA,
        batch_size=10,
    )
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        for _ in range(2):
            assert (await worker.run_once(conn, now=T0)).done == 10
        assert sorted({s for s, _, _ in effects(effects_dsn)}) == ["a", "b"]
    await run_batches(worker, effects_dsn, now=T0)
    assert len(effects(effects_dsn)) == 60
