"""The soak's phases: what each does to the database while the load runs at its offered rate.

Each phase is a name, a rate factor (the offered rate is the baseline's times it) and a fault: an
async context manager entered for the phase's whole length, against every database of the run
(pgonce's and pgqueuer's, so that both systems live through the same phase at the same moment).

- ``baseline``, ``recovery``: nothing; the recovery measures the catch-up.
- ``idle-in-tx``: one connection per database runs ``BEGIN; SELECT txid_current();`` and holds
  it: the MVCC horizon is pinned, no dead row of that database can be reclaimed.
- ``high-load``: producers at 1.5 times the baseline rate.
- ``active-readers``: four REPEATABLE READ connections per database scanning the hot tables,
  each in transactions of :data:`READER_TX_SECONDS` (a reporting job's), which pin the horizon
  in turns.
- ``pg-backend-kill``: ``pg_terminate_backend`` of one of the systems' connections (the service,
  the payments app, the producers, pgqueuer's workers) :data:`KILLS_PER_SECOND` times a second.
- ``pool-exhaustion``: :data:`HELD_CONNECTIONS` idle connections held against the databases.

The harness's own connections (sampler, readers, holders) carry the application name
:data:`HARNESS`; the kills never take them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from faults.load import FaultLog

#: The application name of every connection the harness opens for itself.
HARNESS = "soak-harness"
#: How often the kill phase terminates one of the systems' connections.
KILLS_PER_SECOND = 4
#: How many idle connections the pool-exhaustion phase holds (the issue's 300).
HELD_CONNECTIONS = 300
#: Readers per database in the active-readers phase, and how long each of their transactions is.
READERS = 4
READER_TX_SECONDS = 10.0
#: The pause between two scans of a reader (four readers scanning back to back would take the
#: machine's two cores for themselves).
READER_PAUSE = 0.2
#: Connections the pool-exhaustion phase opens at once.
OPEN_AT_ONCE = 25


@dataclass
class Target:
    """One database of the run: its DSN and the hot tables its readers scan."""

    dsn: str
    hot_tables: list[str]


@dataclass
class FaultStats:
    """What a phase's fault did, for the report (kills, connections held, scans)."""

    done: int = 0
    failed: int = 0
    notes: list[str] = field(default_factory=list)


async def harness_connect(dsn: str, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(
        dsn, application_name=HARNESS, connect_timeout=5, **kwargs
    )


Fault = Callable[[list[Target], FaultStats, FaultLog], contextlib.AbstractAsyncContextManager[None]]


@contextlib.asynccontextmanager
async def nothing(targets: list[Target], stats: FaultStats, log: FaultLog) -> AsyncIterator[None]:
    yield


@contextlib.asynccontextmanager
async def idle_in_tx(
    targets: list[Target], stats: FaultStats, log: FaultLog
) -> AsyncIterator[None]:
    conns = [await harness_connect(t.dsn) for t in targets]
    try:
        for conn in conns:
            row = await (await conn.execute("SELECT txid_current()")).fetchone()
            stats.done += 1
            stats.notes.append(f"transaction {row[0] if row else '?'} held open")
        yield
    finally:
        for conn in conns:
            await conn.close()


async def _reader(target: Target, stats: FaultStats, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            conn = await harness_connect(target.dsn)
            async with conn:
                await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
                while not stop.is_set():
                    began = time.monotonic()
                    async with conn.transaction():
                        while not stop.is_set() and time.monotonic() - began < READER_TX_SECONDS:
                            for table in target.hot_tables:
                                await conn.execute(f"SELECT count(*) FROM {table}")
                                stats.done += 1
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(stop.wait(), READER_PAUSE)
        except psycopg.Error:
            stats.failed += 1
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def active_readers(
    targets: list[Target], stats: FaultStats, log: FaultLog
) -> AsyncIterator[None]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_reader(t, stats, stop)) for t in targets for _ in range(READERS)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        stats.notes.append(f"{READERS} readers per database, {stats.done} table scans")


#: The systems' connections in the run's databases: client backends not of the harness.
SYSTEM_BACKENDS = (
    "SELECT pid FROM pg_stat_activity WHERE datname = ANY(%s) AND backend_type = 'client backend' "
    "AND application_name <> %s AND pid <> pg_backend_pid()"
)


async def _killer(
    targets: list[Target], stats: FaultStats, log: FaultLog, stop: asyncio.Event, rng: random.Random
) -> None:
    names = [psycopg.conninfo.conninfo_to_dict(t.dsn).get("dbname") for t in targets]
    conn = await harness_connect(targets[0].dsn, autocommit=True)
    async with conn:
        while not stop.is_set():
            cur = await conn.execute(SYSTEM_BACKENDS, (names, HARNESS))
            pids = [r[0] for r in await cur.fetchall()]
            if pids:
                began = time.time()
                row = await (
                    await conn.execute("SELECT pg_terminate_backend(%s)", (rng.choice(pids),))
                ).fetchone()
                log.add("pg_terminate_backend", began)
                if row and row[0]:
                    stats.done += 1
                else:
                    stats.failed += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1 / KILLS_PER_SECOND)


@contextlib.asynccontextmanager
async def backend_kill(
    targets: list[Target], stats: FaultStats, log: FaultLog
) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(_killer(targets, stats, log, stop, random.Random(len(targets))))
    # The phase as a whole is a fault too. A relay's batch is one transaction (claim, publish,
    # mark): a kill between its claim and its publish is seen only at the mark, so the batch's
    # first copies go out after the kill's own window has ended and their second after the
    # rows were claimed again -- a redelivery that the kill caused but its window does not
    # cover. With kills four times a second, any moment of the phase may be such a batch's.
    with log.window("pg_terminate_backend, the whole phase"):
        try:
            yield
        finally:
            stop.set()
            await task
        stats.notes.append(f"{stats.done} backends terminated ({KILLS_PER_SECOND}/s)")


@contextlib.asynccontextmanager
async def pool_exhaustion(
    targets: list[Target], stats: FaultStats, log: FaultLog
) -> AsyncIterator[None]:
    held: list[psycopg.AsyncConnection[Any]] = []
    try:
        # Opened a batch at a time, all against the databases at once (each is a new backend).
        for start in range(0, HELD_CONNECTIONS, OPEN_AT_ONCE):
            opened = await asyncio.gather(
                *(
                    harness_connect(targets[i % len(targets)].dsn, autocommit=True)
                    for i in range(start, min(start + OPEN_AT_ONCE, HELD_CONNECTIONS))
                ),
                return_exceptions=True,
            )
            for conn in opened:
                if isinstance(conn, BaseException):
                    stats.failed += 1
                    if stats.failed == 1:
                        stats.notes.append(f"a connection refused: {str(conn).strip()[:120]}")
                else:
                    held.append(conn)
        stats.done = len(held)
        stats.notes.append(f"{len(held)} idle connections held")
        yield
    finally:
        await asyncio.gather(*(conn.close() for conn in held))


@dataclass(frozen=True)
class Phase:
    name: str
    #: The offered rate in this phase, as a multiple of the baseline's.
    factor: float
    fault: Fault
    what: str


PHASES: dict[str, Phase] = {
    p.name: p
    for p in (
        Phase("baseline", 1.0, nothing, "the offered rate, nothing else"),
        Phase(
            "idle-in-tx",
            1.0,
            idle_in_tx,
            "one connection per database holds `BEGIN; SELECT txid_current();` for the phase",
        ),
        Phase("high-load", 1.5, nothing, "producers at 1.5 × the baseline rate"),
        Phase(
            "active-readers",
            1.0,
            active_readers,
            f"{READERS} REPEATABLE READ connections per database scanning the hot tables "
            f"(transactions of {READER_TX_SECONDS:.0f} s)",
        ),
        Phase(
            "pg-backend-kill",
            1.0,
            backend_kill,
            f"`pg_terminate_backend` of a random connection of the systems, "
            f"{KILLS_PER_SECOND} times a second",
        ),
        Phase(
            "pool-exhaustion",
            1.0,
            pool_exhaustion,
            f"{HELD_CONNECTIONS} idle connections held against the databases",
        ),
        Phase("recovery", 1.0, nothing, "back to the baseline rate: the catch-up"),
    )
}
