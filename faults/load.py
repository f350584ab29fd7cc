"""The load the scenarios put on pgonce, and the exact accounting of its effects.

Three producers, each behaving like the real client it stands for:

- :class:`WebhookLoad` is a webhook provider: it signs each event, delivers it, and redelivers it
  (same id, same body) until it gets a 200 -- across kills, restarts and cut connections.
- :class:`PaymentLoad` is an API client with Idempotency-Keys: it retries a payment with the same
  key until it gets the 201, then checks that a later retry replays that 201 byte for byte.
- :class:`OutboxLoad` is an application that enqueues outbox rows in its own transactions.

The accounting is computed from the database (the handler's rows, the payments, the outbox) and
from the broker, never from the producers' own counters: ``lost`` is an acknowledged item with no
effect, ``doubled`` an effect beyond the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
import redis.asyncio as aioredis

from pgonce.config import own_connect_kwargs
from pgonce.consumers import Handler, IdempotentConsumer
from pgonce.relay import DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY
from pgonce.store._async.outbox import enqueue
from pgonce.webhooks.schemes.base import SigningScheme

#: A request that got no answer is retried after this pause (a provider's retry, compressed).
RETRY_PAUSE = 0.05
#: Attempts at each replay of an acknowledged payment before it counts as differing.
REPLAY_ATTEMPTS = 20


@dataclass
class Accounting:
    """What a scenario's checks compare: items sent, effects observed, lost, doubled."""

    sent: int = 0
    acknowledged: int = 0
    effects: int = 0
    lost: int = 0
    doubled: int = 0
    #: Outbox rows the broker holds more than once under the same message id (at-least-once
    #: publishing: a consumer that dedupes on the id sees one).
    redelivered: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    #: What was counted ("webhooks", "payments", "outbox"), for the per-producer notes.
    label: str = ""

    def summary(self) -> str:
        return (
            f"{self.label}: sent {self.sent}, acknowledged {self.acknowledged}, effects "
            f"{self.effects}, lost {self.lost}, doubled {self.doubled}"
        )

    def add(self, other: Accounting) -> None:
        self.sent += other.sent
        self.acknowledged += other.acknowledged
        self.effects += other.effects
        self.lost += other.lost
        self.doubled += other.doubled
        self.redelivered += other.redelivered
        self.statuses.update(other.statuses)
        self.notes.extend(other.notes)

    @property
    def http_500(self) -> int:
        return sum(
            n for s, n in self.statuses.items() if _code(s).startswith("5") and _code(s) != "503"
        )

    @property
    def http_503(self) -> int:
        return sum(n for s, n in self.statuses.items() if _code(s) == "503")


def combine(*parts: Accounting) -> Accounting:
    """The sum of ``parts``, with one note per part saying its own figures."""
    total = Accounting(notes=[p.summary() for p in parts])
    for part in parts:
        total.add(part)
    return total


def _code(status: str) -> str:
    """The status code in a tally key such as ``"payments 201"`` or ``"409"``."""
    return status.rsplit(" ", 1)[-1]


def _status(response: httpx.Response | None, error: BaseException | None = None) -> str:
    if response is not None:
        return str(response.status_code)
    return "no answer"


class WebhookLoad:
    """Deliver events ``evt_<run>_<n>`` to ``url`` until each is acknowledged with a 200."""

    def __init__(self, url: str, run: str, scheme: SigningScheme, *, concurrency: int = 8) -> None:
        self.url = url
        self.run = run
        self.scheme = scheme
        self.concurrency = concurrency
        self.next = 0
        self.acked: set[int] = set()
        self.statuses: Counter[str] = Counter()
        self.bodies: list[bytes] = []

    def delivery(self, n: int) -> tuple[bytes, dict[str, str]]:
        body = json.dumps(
            {"type": "order.created", "data": {"run": self.run, "order": f"o-{n}", "amount": n}}
        ).encode()
        headers = self.scheme.sign(body, event_id=f"evt_{self.run}_{n}")
        return body, {**headers, "content-type": "application/json"}

    async def _deliver(self, client: httpx.AsyncClient, n: int, deadline: float) -> None:
        body, headers = self.delivery(n)
        while time.monotonic() < deadline:
            response = None
            with contextlib.suppress(httpx.HTTPError):
                response = await client.post(self.url, content=body, headers=headers)
            self.statuses[f"webhooks {_status(response)}"] += 1
            if response is not None and response.status_code == 200:
                self.acked.add(n)
                return
            if response is not None and response.status_code != 503:
                self.bodies.append(response.content)
            await asyncio.sleep(RETRY_PAUSE)

    async def run_until(self, stop: asyncio.Event, *, limit: int | None = None,
                        drain_seconds: float = 120) -> None:  # fmt: skip
        """Deliver new events until ``stop`` (or ``limit`` events); finish redelivering the
        unacknowledged ones for at most ``drain_seconds`` after that."""
        deadline = float("inf")

        async def lane(client: httpx.AsyncClient) -> None:
            nonlocal deadline
            while not stop.is_set() and (limit is None or self.next < limit):
                n = self.next
                self.next += 1
                await self._deliver(client, n, min(deadline, time.monotonic() + 3600))
            deadline = min(deadline, time.monotonic() + drain_seconds)

        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            await asyncio.gather(*(lane(client) for _ in range(self.concurrency)))

    def account(self, dsn: str) -> Accounting:
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT order_ref, count(*) FROM pgonce_demo.webhook_orders WHERE run_id = %s "
                "GROUP BY order_ref",
                (self.run,),
            ).fetchall()
        per_order = {str(ref): int(count) for ref, count in rows}
        acked_refs = {f"o-{n}" for n in self.acked}
        return Accounting(
            label="webhooks",
            sent=self.next,
            acknowledged=len(self.acked),
            effects=len(per_order),
            lost=len(acked_refs - per_order.keys()),
            doubled=sum(c - 1 for c in per_order.values()),
            statuses=Counter(self.statuses),
        )

    def handled(self, dsn: str) -> int:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT count(DISTINCT order_ref) FROM pgonce_demo.webhook_orders "
                "WHERE run_id = %s",
                (self.run,),
            ).fetchone()
        return int(row[0]) if row else 0

    def unresolved(self, dsn: str) -> int:
        """Events of this run stored in the inbox and not done (pending, failed, dead)."""
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pgonce.inbox WHERE source = 'shop' AND event_id LIKE %s "
                "AND status <> 'done'",
                (f"evt_{self.run}_%",),
            ).fetchone()
        return int(row[0]) if row else 0


class PaymentLoad:
    """POST /payments with Idempotency-Key ``<run>-<n>`` until each gets its 201."""

    TOKEN = "alice-token"

    def __init__(self, url: str, run: str, base: int, *, concurrency: int = 4) -> None:
        self.url = url
        self.run = run
        #: Amounts are ``base + n``: the payments table has no key column, the amount names it.
        self.base = base
        self.concurrency = concurrency
        self.next = 0
        self.first: dict[int, bytes] = {}
        self.statuses: Counter[str] = Counter()
        self.bodies: list[bytes] = []

    def request(self, n: int) -> tuple[bytes, dict[str, str]]:
        body = json.dumps({"amount": self.base + n, "currency": "EUR"}).encode()
        return body, {
            "authorization": f"Bearer {self.TOKEN}",
            "idempotency-key": f'"{self.run}-{n}"',
            "content-type": "application/json",
        }

    async def _pay(self, client: httpx.AsyncClient, n: int, deadline: float) -> None:
        body, headers = self.request(n)
        while time.monotonic() < deadline:
            response = None
            with contextlib.suppress(httpx.HTTPError):
                response = await client.post(self.url, content=body, headers=headers)
            self.statuses[f"payments {_status(response)}"] += 1
            if response is not None and response.status_code == 201:
                self.first.setdefault(n, response.content)
                return
            if response is not None and response.status_code not in (409, 503):
                self.bodies.append(response.content)
            await asyncio.sleep(RETRY_PAUSE)

    async def run_until(self, stop: asyncio.Event, *, drain_seconds: float = 120) -> None:
        deadline = float("inf")

        async def lane(client: httpx.AsyncClient) -> None:
            nonlocal deadline
            while not stop.is_set():
                n = self.next
                self.next += 1
                await self._pay(client, n, min(deadline, time.monotonic() + 3600))
            deadline = min(deadline, time.monotonic() + drain_seconds)

        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(lane(client) for _ in range(self.concurrency)))

    async def replays_differ(self) -> int:
        """Retry every acknowledged key once more: the answer must be the first 201, verbatim."""
        differ = 0
        async with httpx.AsyncClient(timeout=30) as client:
            for n, first in self.first.items():
                body, headers = self.request(n)
                response = None
                # A client retries a transport error or a 503, as during the load; a bounded few.
                for _ in range(REPLAY_ATTEMPTS):
                    with contextlib.suppress(httpx.HTTPError):
                        response = await client.post(self.url, content=body, headers=headers)
                    self.statuses[f"payments replay {_status(response)}"] += 1
                    if response is not None and response.status_code != 503:
                        break
                    await asyncio.sleep(RETRY_PAUSE)
                if response is None or response.status_code != 201 or response.content != first:
                    differ += 1
        return differ

    def account(self, dsn: str) -> Accounting:
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT amount, count(*) FROM payments WHERE principal = 'alice' "
                "AND amount >= %s AND amount < %s GROUP BY amount",
                (self.base, self.base + max(self.next, 1)),
            ).fetchall()
        per_key = {int(amount) - self.base: int(count) for amount, count in rows}
        return Accounting(
            label="payments",
            sent=self.next,
            acknowledged=len(self.first),
            effects=len(per_key),
            lost=len(self.first.keys() - per_key.keys()),
            doubled=sum(c - 1 for c in per_key.values()),
            statuses=Counter(self.statuses),
        )


@dataclass(frozen=True)
class FaultWindow:
    """When one injected fault began and when the system had it behind it (wall clock, seconds)."""

    what: str
    began: float
    ended: float


@dataclass
class FaultLog:
    """The faults a scenario injected, with their time windows: what a broker copy may be
    explained by. A scenario records each fault with :meth:`window` (or :meth:`add`)."""

    windows: list[FaultWindow] = field(default_factory=list)

    @contextlib.contextmanager
    def window(self, what: str) -> Iterator[None]:
        began = time.time()
        try:
            yield
        finally:
            self.windows.append(FaultWindow(what, began, time.time()))

    def add(self, what: str, began: float) -> None:
        self.windows.append(FaultWindow(what, began, time.time()))

    def __len__(self) -> int:
        return len(self.windows)

    def explains(self, first: float, later: float) -> bool:
        """Whether some fault explains a copy published at ``later`` after one at ``first``: the
        earlier copy went out before the fault was over, the later one after it began."""
        return any(
            first <= w.ended + COPY_SLACK and later >= w.began - COPY_SLACK for w in self.windows
        )


#: Redis stamps an entry with the machine's clock in whole milliseconds, and a window is recorded
#: on the same clock around the fault's action (from just before it to after the recovery): a
#: copy's stamp is compared with a window to the millisecond. No more slack: a window widened by
#: scheduling noise would cover the whole run and explain any copy.
COPY_SLACK = 0.001
#: The consumer's name in the scenarios' databases (the scope of its claims).
CONSUMER = "faults-consumer"
#: Consumers draining a stream at once, each on its own connection.
CONSUMER_LANES = 4
#: Where the consumer's handler writes one row per run of the handler: no unique key, so that an
#: effect that happened twice is counted twice.
EFFECTS_TABLE = """
CREATE TABLE IF NOT EXISTS faults_outbox_effects (
    run text NOT NULL,
    message_id text NOT NULL
)
"""


def _record_effect(run: str, message_id: str) -> Handler:
    """The consumer's handler: one row per run of it."""

    async def effect(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(
            "INSERT INTO faults_outbox_effects (run, message_id) VALUES (%s, %s)", (run, message_id)
        )

    return effect


@dataclass(frozen=True)
class StreamEntry:
    """One copy the broker holds: its message id and when Redis appended it (from its entry id)."""

    message_id: str
    at: float
    payload: bytes


class OutboxLoad:
    """Enqueue outbox rows (aggregate type ``<run>``), one transaction each, over ``dsn``."""

    def __init__(self, dsn: str, run: str) -> None:
        self.dsn = dsn
        self.run = run
        self.committed: set[int] = set()
        self.in_doubt = 0
        self.attempts = 0

    async def run_until(self, stop: asyncio.Event, *, pause: float = 0.005) -> None:
        rng = random.Random(self.run)
        conn: psycopg.AsyncConnection[Any] | None = None
        n = 0
        while not stop.is_set():
            try:
                if conn is None or conn.closed:
                    # As an application configured for its pooler: no prepared statements
                    # behind a transaction-mode pooler (PGONCE_POOLER), as pgonce's own.
                    conn = await psycopg.AsyncConnection.connect(
                        self.dsn, connect_timeout=3, **own_connect_kwargs()
                    )
                self.attempts += 1
                async with conn.transaction():
                    row_id = await enqueue(
                        conn, self.run, f"agg-{rng.randrange(20)}", "tick", {"n": n}
                    )
                self.committed.add(row_id)
                n += 1
            except Exception:
                # A commit whose answer was lost may or may not have happened: the database says.
                self.in_doubt += 1
                if conn is not None:
                    await conn.close()
                conn = None
                await asyncio.sleep(0.1)
            await asyncio.sleep(pause)
        if conn is not None:
            await conn.close()

    def rows(self, dsn: str) -> tuple[set[int], set[int]]:
        """Ids of this run's rows in the outbox, and those of them not marked published."""
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT id, published_at IS NULL FROM pgonce.outbox WHERE aggregatetype = %s",
                (self.run,),
            ).fetchall()
        return {int(r[0]) for r in rows}, {int(r[0]) for r in rows if r[1]}

    async def entries(self, redis_url: str) -> list[StreamEntry]:
        """Every copy the broker holds for this run, in the stream's order."""
        client = aioredis.from_url(redis_url)
        raw: list[Any] = []
        try:
            # Entries are (entry id, fields) with bytes keys: the client does not decode. Read in
            # pages, so that a relay flooding the stream fails the checks instead of the read.
            start = b"-"
            while True:
                page: Any = await client.xrange(f"outbox.{self.run}", min=start, count=10_000)
                if not page:
                    break
                raw.extend(page)
                start = b"(" + page[-1][0]
        finally:
            await client.aclose()
        return [
            StreamEntry(
                message_id=fields[b"message-id"].decode(),
                # The entry id is "<milliseconds>-<sequence>", stamped by Redis on XADD.
                at=int(entry_id.split(b"-")[0]) / 1000,
                payload=fields[b"payload"],
            )
            for entry_id, fields in raw
        ]

    async def consume(self, dsn: str, entries: list[StreamEntry]) -> Counter[str]:
        """Run every copy through pgonce's idempotent consumer, as a consumer of the stream
        would; return the handler's effects per message id, counted in the database."""
        consumer = IdempotentConsumer(CONSUMER)
        queue: asyncio.Queue[StreamEntry] = asyncio.Queue()
        for entry in entries:
            queue.put_nowait(entry)

        async def lane() -> None:
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                while not queue.empty():
                    entry = queue.get_nowait()
                    effect = _record_effect(self.run, entry.message_id)
                    outcome = await consumer.handle(conn, entry.message_id, entry.payload, effect)
                    if not outcome.acknowledge:
                        # Another lane holds the same id right now: requeue, as a broker would.
                        queue.put_nowait(entry)
                        await asyncio.sleep(0.01)

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(EFFECTS_TABLE)
        await asyncio.gather(*(lane() for _ in range(CONSUMER_LANES)))
        with psycopg.connect(dsn) as conn:
            counted = conn.execute(
                "SELECT message_id, count(*) FROM faults_outbox_effects WHERE run = %s "
                "GROUP BY message_id",
                (self.run,),
            ).fetchall()
        return Counter({str(m): int(n) for m, n in counted})

    async def account(
        self, dsn: str, redis_url: str, faults: FaultLog, *, relay_loops: int, within: float = 60
    ) -> tuple[Accounting, list[tuple[str, bool]]]:
        """Wait (bounded) until every row is published, consume the stream, and compare.

        ``doubled`` counts the consumer's effects beyond the first per message id. Broker copies
        with a repeated id (``redelivered``) are at-least-once publishing only where a fault
        explains them: a fault can make a relay publish again at most what it had in flight
        (``relay_loops`` batch loops of :data:`~pgonce.relay.DEFAULT_BATCH_SIZE` rows each), and
        only a copy that went out after that fault began while the copy before it went out before
        the fault was over. Returns the accounting and its checks."""
        deadline = time.monotonic() + within
        ids, pending = self.rows(dsn)
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            ids, pending = self.rows(dsn)
        entries = await self.entries(redis_url)
        effects = await self.consume(dsn, entries)
        times: dict[str, list[float]] = {}
        for entry in entries:
            times.setdefault(entry.message_id, []).append(entry.at)
        published = {int(m) for m in times}
        copies = len(entries) - len(times)
        # Each copy against the one before it: a fault explains one more copy of a row, not
        # every copy that follows it.
        unexplained = sum(
            1
            for at in times.values()
            for before, later in itertools.pairwise(sorted(at))
            if not faults.explains(before, later)
        )
        bound = len(faults) * relay_loops * DEFAULT_BATCH_SIZE
        unmarked = published & pending
        acc = Accounting(
            label="outbox",
            sent=len(ids),
            acknowledged=len(self.committed),
            effects=len(effects),
            lost=len(ids - {int(m) for m in effects}) + len(self.committed - ids),
            doubled=sum(n - 1 for n in effects.values()),
            redelivered=copies,
        )
        acc.notes.append(
            f"outbox: {len(ids)} rows committed ({self.in_doubt} enqueue transactions failed or "
            f"in doubt), {len(pending)} left unpublished, {len(entries)} broker copies of "
            f"{len(times)} message ids consumed by pgonce's idempotent consumer, {copies} "
            f"redelivered ({unexplained} not explained by a fault; bound {bound})"
        )
        checks = [
            (
                f"every outbox row the broker received is marked published ({len(unmarked)} not)",
                not unmarked,
            ),
            (
                f"every redelivered copy is explained by a fault: the copy before it went out "
                f"before a fault ended and it after that fault began ({unexplained} not)",
                unexplained == 0,
            ),
            (
                f"redelivered copies ({copies}) within what {len(faults)} faults can leave in "
                f"flight ({relay_loops} batch loops × {DEFAULT_BATCH_SIZE} rows each: {bound})",
                copies <= bound,
            ),
            (
                "the idempotent consumer acknowledged every copy and ran its handler once per "
                "message id",
                set(effects) == set(times),
            ),
        ]
        return acc, checks


async def wait_handled(load: WebhookLoad, dsn: str, within: float = 120) -> None:
    """Bounded wait until every acknowledged event's handler effect is visible."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await asyncio.to_thread(load.handled, dsn) >= len(load.acked):
            return
        await asyncio.sleep(0.2)


#: What :class:`MixedLoad` does, for the report.
MIXED_LOAD = (
    "a provider redelivering signed events until 200 (8 lanes), an API client retrying POST "
    "/payments with its Idempotency-Key until 201 (3 lanes), an application enqueueing outbox "
    "rows; all continuous while the faults happen"
)


class MixedLoad:
    """The three producers at once, as the kill and database scenarios run them.

    ``relays`` is how many relays publish this load's outbox (each runs
    :data:`~pgonce.relay.DEFAULT_CONCURRENCY` batch loops); the scenario records every fault it
    injects in :attr:`faults`, which is what may explain a broker copy published twice.
    """

    def __init__(
        self, scheme: SigningScheme, *, service_port: int, payments_port: int, outbox_dsn: str,
        run: str, amounts: int, relays: int, minimum: int,
    ) -> None:  # fmt: skip
        self.hooks = WebhookLoad(f"http://127.0.0.1:{service_port}/webhooks/shop", run, scheme)
        self.pays = PaymentLoad(
            f"http://127.0.0.1:{payments_port}/payments", run, amounts, concurrency=3
        )
        self.outbox = OutboxLoad(outbox_dsn, run)
        self.relay_loops = relays * DEFAULT_CONCURRENCY
        #: The fewest events, payments and outbox rows each producer must have had acknowledged
        #: for the run to prove anything.
        self.minimum = minimum
        self.faults = FaultLog()
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.replays_differ = 0
        self.unresolved = 0
        self.outbox_checks: list[tuple[str, bool]] = []

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(self.hooks.run_until(self.stop)),
            asyncio.create_task(self.pays.run_until(self.stop)),
            asyncio.create_task(self.outbox.run_until(self.stop)),
        ]

    async def finish(self, dsn: str, redis_url: str, *, within: float = 60) -> Accounting:
        """Stop producing, let the producers finish their retries, wait (bounded) for the
        effects (``within`` seconds each), retry every paid key once more, and account."""
        self.stop.set()
        await asyncio.gather(*self.tasks)
        await wait_handled(self.hooks, dsn, within)
        self.replays_differ = await self.pays.replays_differ()
        self.unresolved = await asyncio.to_thread(self.hooks.unresolved, dsn)
        outbox, self.outbox_checks = await self.outbox.account(
            dsn, redis_url, self.faults, relay_loops=self.relay_loops, within=within
        )
        return combine(
            await asyncio.to_thread(self.hooks.account, dsn),
            await asyncio.to_thread(self.pays.account, dsn),
            outbox,
        )

    @property
    def bodies(self) -> list[bytes]:
        return self.hooks.bodies + self.pays.bodies

    def checks(self) -> list[tuple[str, bool]]:
        hooks, pays, outbox = self.hooks, self.pays, self.outbox
        return [
            (
                f"the load proves something: at least {self.minimum} events, payments and outbox "
                f"rows each acknowledged (got {len(hooks.acked)}, {len(pays.first)}, "
                f"{len(outbox.committed)})",
                min(len(hooks.acked), len(pays.first), len(outbox.committed)) >= self.minimum,
            ),
            (
                "every event and every payment was acknowledged in the end (the producers' "
                "retries got their 200 and 201)",
                len(hooks.acked) == hooks.next and len(pays.first) == pays.next,
            ),
            (
                "every acknowledged payment's key replays its first 201 byte for byte",
                self.replays_differ == 0,
            ),
            ("no inbox event left pending, failed or dead", self.unresolved == 0),
            *self.outbox_checks,
        ]
