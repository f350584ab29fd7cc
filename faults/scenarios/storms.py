"""Retry storms: many identical requests at the same moment, for many keys.

- Through the Idempotency-Key middleware (the example payments app on uvicorn): for each key, N
  identical POSTs at once. Exactly one payment per key; every 201 a client got for a key is the
  same bytes, and a later retry replays them; the rest are 409 "in flight" (retry later).
- Through the service's webhook endpoint: for each event, N identical signed deliveries at once.
  Every one is answered 200 (exactly one "stored", the rest "duplicate") and the handler writes
  exactly one row per event.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict

import httpx

from faults.context import Context
from faults.load import RETRY_PAUSE, Accounting, WebhookLoad, wait_handled
from faults.proxy import free_port
from faults.report import Result

#: A request that got no answer (connection reset, timeout) is sent again, with the same key and
#: body, as a real client would, at most this many times.
TRANSPORT_RETRIES = 20
#: What a transport error is tallied as among the answers.
NO_ANSWER = "no answer (retried)"


async def at_once(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    copies: int,
    statuses: Counter[str],
) -> list[httpx.Response]:
    """``copies`` identical POSTs, all released together once every one is ready to go. A copy
    that gets no answer is counted in ``statuses`` and sent again, identical, until it does."""
    gate = asyncio.Event()

    async def post() -> httpx.Response:
        await gate.wait()
        for _ in range(TRANSPORT_RETRIES):
            try:
                return await client.post(url, content=body, headers=headers)
            except httpx.TransportError:
                statuses[NO_ANSWER] += 1
                await asyncio.sleep(RETRY_PAUSE)
        return await client.post(url, content=body, headers=headers)

    tasks = [asyncio.create_task(post()) for _ in range(copies)]
    await asyncio.sleep(0)
    gate.set()
    return list(await asyncio.gather(*tasks))


async def middleware_storm(ctx: Context) -> Result:
    keys, copies = ctx.size(50, 10), ctx.size(200, 40)
    result = Result(
        "storm: Idempotency-Key middleware",
        f"{keys} keys × {copies} identical concurrent POST /payments "
        f"({keys * copies} requests), then one retry per key",
        "none (concurrency only)",
    )
    dsn = ctx.database("storm_http")
    port = free_port()
    with ctx.processes() as procs:
        procs.payments("storm-payments", dsn, port)
        ctx.keep_logs(procs)
        url = f"http://127.0.0.1:{port}/payments"
        statuses: Counter[str] = Counter()
        created: dict[int, set[bytes]] = defaultdict(set)
        limits = httpx.Limits(max_connections=copies, max_keepalive_connections=copies)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            for k in range(keys):
                body = json.dumps({"amount": 1_000_000 + k, "currency": "EUR"}).encode()
                headers = {
                    "authorization": "Bearer alice-token",
                    "idempotency-key": f'"storm-{k}"',
                    "content-type": "application/json",
                }
                for response in await at_once(client, url, body, headers, copies, statuses):
                    statuses[str(response.status_code)] += 1
                    if response.status_code == 201:
                        created[k].add(response.content)
                    elif response.status_code != 409:
                        ctx.bodies.append(response.content)
                retry = await client.post(url, content=body, headers=headers)
                statuses[f"retry {retry.status_code}"] += 1
                if retry.status_code == 201:
                    created[k].add(retry.content)
                else:
                    ctx.bodies.append(retry.content)
    rows = await asyncio.to_thread(_payments, dsn, 1_000_000, keys)
    result.acc = Accounting(
        sent=keys,
        acknowledged=len(created),
        effects=len(rows),
        lost=len(created.keys() - rows.keys()),
        doubled=sum(c - 1 for c in rows.values()),
        statuses=statuses,
    )
    result.check("exactly one payment per key", all(rows.get(k) == 1 for k in range(keys)))
    result.check(
        "every 201 of a key is byte-identical (the first answer and its replays)",
        all(len(bodies) == 1 for bodies in created.values()) and len(created) == keys,
    )
    result.check(
        "answers are only 201 (first or replay) and 409 (in flight: retry later)",
        set(statuses) <= {"201", "409", "retry 201", NO_ANSWER},
    )
    result.acc.notes.append(
        f"{statuses[NO_ANSWER]} requests got no answer (a transport error) and were sent again "
        "with the same key"
    )
    return result


def _payments(dsn: str, base: int, keys: int) -> dict[int, int]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT amount, count(*) FROM payments WHERE amount >= %s AND amount < %s "
            "GROUP BY amount",
            (base, base + keys),
        ).fetchall()
    return {int(a) - base: int(c) for a, c in rows}


async def webhook_storm(ctx: Context) -> Result:
    events, copies = ctx.size(50, 10), ctx.size(200, 40)
    result = Result(
        "storm: webhook endpoint",
        f"{events} events × {copies} identical concurrent signed deliveries "
        f"({events * copies} requests) to `pgonce serve`",
        "none (concurrency only)",
    )
    dsn = ctx.database("storm_webhooks")
    port = free_port()
    load = WebhookLoad(f"http://127.0.0.1:{port}/webhooks/shop", "storm", ctx.scheme)
    outcomes: dict[int, Counter[str]] = defaultdict(Counter)
    statuses: Counter[str] = Counter()
    with ctx.processes() as procs:
        procs.service("storm-service", dsn, port)
        ctx.keep_logs(procs)
        limits = httpx.Limits(max_connections=copies, max_keepalive_connections=copies)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            for n in range(events):
                body, headers = load.delivery(n)
                for response in await at_once(client, load.url, body, headers, copies, statuses):
                    statuses[str(response.status_code)] += 1
                    if response.status_code == 200:
                        outcomes[n][response.json()["outcome"]] += 1
                    else:
                        ctx.bodies.append(response.content)
                load.acked.add(n)
        load.next = events
        await wait_handled(load, dsn, within=60)
    result.acc = await asyncio.to_thread(load.account, dsn)
    result.acc.statuses = statuses
    result.check(
        "every delivery answered 200: exactly one 'stored' per event, the rest 'duplicate' (no "
        "'stored' only where the answer to a delivery was lost and its retry was a duplicate)",
        all(
            outcomes[n].total() == copies
            and set(outcomes[n]) <= {"stored", "duplicate"}
            and (outcomes[n]["stored"] == 1 or (outcomes[n]["stored"] == 0 and statuses[NO_ANSWER]))
            for n in range(events)
        ),
    )
    result.check(
        "the handler wrote exactly one row per event",
        result.acc.effects == events and result.acc.doubled == 0,
    )
    return result
