"""The receiver through a real uvicorn server: dedupe under concurrency, conflicts, refusals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgonce.core.inbox import Ordering
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, SECRET, effects, eventually, hmac_scheme, serve, source

pytestmark = pytest.mark.slow


def signed(body: bytes, event_id: str | None) -> dict[str, str]:
    return hmac_scheme().sign(body, event_id=event_id)


def order_body(n: int) -> bytes:
    return json.dumps({"type": "order.paid", "order": n}).encode()


async def test_500_concurrent_deliveries_of_100_events_give_100_effects(effects_dsn: str) -> None:
    receiver = InboxReceiver([source()], dsn=effects_dsn, schema=SCHEMA)
    deliveries = [(f"evt_{i % 100}", order_body(i % 100)) for i in range(500)]
    with serve(receiver) as url:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
            responses = await asyncio.gather(
                *(
                    client.post("/webhooks/shop", content=body, headers=signed(body, eid))
                    for eid, body in deliveries
                )
            )
    assert [r.status_code for r in responses] == [200] * 500
    outcomes = [r.json()["outcome"] for r in responses]
    assert outcomes.count("stored") == 100
    assert outcomes.count("duplicate") == 400
    with psycopg.connect(effects_dsn) as conn:
        row = conn.execute(f"SELECT count(*), count(DISTINCT event_id) FROM {SCHEMA}.inbox")
        assert row.fetchone() == (100, 100)

    worker = InboxWorker([source()], dsn=effects_dsn, schema=SCHEMA, concurrency=4, batch_size=7)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    await eventually(lambda: len(effects(effects_dsn)) >= 100)
    stop.set()
    await running
    done = effects(effects_dsn)
    assert len(done) == 100
    assert {e for _, e, _ in done} == {f"evt_{i}" for i in range(100)}


def test_same_id_with_another_body_is_409_and_an_integrity_alert(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = InboxReceiver([source()], dsn=dsn, schema=SCHEMA)
    first, second = b'{"amount":1}', b'{"amount":2}'
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        ok = client.post("/webhooks/shop", content=first, headers=signed(first, "evt_1"))
        again = client.post("/webhooks/shop", content=first, headers=signed(first, "evt_1"))
        with caplog.at_level(logging.WARNING, logger="pgonce.inbox"):
            clash = client.post("/webhooks/shop", content=second, headers=signed(second, "evt_1"))
    assert (ok.status_code, ok.json()["outcome"]) == (200, "stored")
    assert (again.status_code, again.json()["outcome"]) == (200, "duplicate")
    assert clash.status_code == 409
    assert clash.headers["content-type"] == "application/problem+json"
    assert clash.json()["status"] == 409
    alerts = [r for r in caplog.records if r.name == "pgonce.inbox" and "integrity" in r.message]
    assert len(alerts) == 1
    assert "evt_1" in alerts[0].getMessage()
    assert SECRET not in alerts[0].getMessage()
    assert "amount" not in alerts[0].getMessage()
    with psycopg.connect(dsn) as conn:
        stored = conn.execute(f"SELECT body FROM {SCHEMA}.inbox").fetchall()
    assert stored == [(first,)]


def test_refusals_are_problems_with_the_right_status(dsn: str) -> None:
    receiver = InboxReceiver([source(body_limit=64)], dsn=dsn, schema=SCHEMA)
    good = b'{"ok":true}'
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        cases: list[tuple[int, httpx.Response]] = [
            (404, client.post("/webhooks/nope", content=good, headers=signed(good, "e1"))),
            (404, client.post("/other/shop", content=good, headers=signed(good, "e1"))),
            (405, client.get("/webhooks/shop")),
            (401, client.post("/webhooks/shop", content=good)),
            (401, client.post("/webhooks/shop", content=good, headers=signed(b"{}", "e1"))),
            (413, client.post("/webhooks/shop", content=b"x" * 65, headers=signed(b"x" * 65, "e"))),
            (400, client.post("/webhooks/shop", content=b"\xff{}", headers=signed(b"\xff{}", "e"))),
            (400, client.post("/webhooks/shop", content=b"{nope", headers=signed(b"{nope", "e"))),
        ]

        # A chunked body without Content-Length is cut off at the limit, too.
        def chunks() -> Any:
            for _ in range(100):
                yield b"x" * 16

        chunked = client.post("/webhooks/shop", content=chunks(), headers=signed(b"", "e"))
        cases.append((413, chunked))
    for expected, response in cases:
        assert response.status_code == expected, response.text
        problem = response.json()
        assert response.headers["content-type"] == "application/problem+json"
        assert problem["status"] == expected
        assert SECRET not in response.text
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {SCHEMA}.inbox").fetchone() == (0,)


def test_standard_webhooks_delivery_signed_by_the_providers_library(dsn: str) -> None:
    from standardwebhooks.webhooks import Webhook

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    scheme = build_scheme("standard-webhooks", [secret])
    receiver = InboxReceiver([Source(name="sw", scheme=scheme)], dsn=dsn, schema=SCHEMA)
    body = b'{"type":"invoice.paid","id":1}'
    now = datetime.now(UTC)
    signature = Webhook(secret).sign("msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", now, body.decode())
    headers = {
        "webhook-id": "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W",
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
    }
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        response = client.post("/webhooks/sw", content=body, headers=headers)
        stale = dict(headers, **{"webhook-timestamp": str(int(now.timestamp()) - 3600)})
        replayed_late = client.post("/webhooks/sw", content=body, headers=stale)
    assert response.status_code == 200
    assert replayed_late.status_code == 401
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT event_id, headers FROM {SCHEMA}.inbox").fetchone()
    assert row is not None
    assert row[0] == "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"
    # The stored headers are enough to verify the stored delivery again.
    scheme.verify(row[1], body, now=now)


@pytest.mark.parametrize(
    ("provider", "type_header", "kind"),
    [("github", "x-github-event", "push"), ("shopify", "x-shopify-topic", "orders/create")],
)
async def test_a_providers_event_type_header_reaches_its_handler(
    dsn: str, provider: str, type_header: str, kind: str
) -> None:
    """GitHub and Shopify name the event in a header only: it is kept with the delivery, or a
    handler chosen by it never runs and the event is marked done all the same."""
    scheme = build_scheme(provider, [SECRET])
    ran: list[str] = []

    async def on_kind(event: Any, conn: Any) -> None:
        ran.append(event.id)

    shop = Source(
        name="provider",
        scheme=scheme,
        handlers={kind: on_kind},
        event_type=lambda payload, headers: headers.get(type_header),
    )
    body = b'{"id": 820982911946154508}'
    headers = {**scheme.sign(body, event_id="d-1"), type_header: kind, "x-unrelated": "dropped"}
    receiver = InboxReceiver([shop], dsn=dsn, schema=SCHEMA)
    with serve(receiver) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            answer = await client.post("/webhooks/provider", content=body, headers=headers)
    assert answer.status_code == 200
    worker = InboxWorker([shop], dsn=dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        result = await worker.run_once(conn)
    assert (result.done, ran) == (1, ["d-1"])
    with psycopg.connect(dsn) as sync_conn:
        row = sync_conn.execute(f"SELECT headers FROM {SCHEMA}.inbox").fetchone()
    assert row is not None
    assert row[0][type_header] == kind
    assert "x-unrelated" not in row[0]


def test_slacks_url_verification_is_answered_with_its_challenge_and_not_stored(dsn: str) -> None:
    """Slack accepts a Request URL only when the handshake's answer echoes its challenge."""
    scheme = build_scheme("slack", [SECRET])
    receiver = InboxReceiver([Source(name="slack", scheme=scheme)], dsn=dsn, schema=SCHEMA)
    handshake = b'{"token":"t","challenge":"3eZbrw1aBm2rZgRNFdxV","type":"url_verification"}'
    event = b'{"type":"event_callback","event_id":"Ev1","event":{"type":"app_mention"}}'
    forged = handshake.replace(b"3eZb", b"XXXX")
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        answered = client.post("/webhooks/slack", content=handshake, headers=scheme.sign(handshake))
        stored = client.post("/webhooks/slack", content=event, headers=scheme.sign(event))
        refused = client.post("/webhooks/slack", content=forged, headers=scheme.sign(handshake))
    assert (answered.status_code, answered.json()) == (200, {"challenge": "3eZbrw1aBm2rZgRNFdxV"})
    assert answered.headers["content-type"] == "application/json"
    assert (stored.status_code, stored.json()) == (200, {"outcome": "stored"})
    assert refused.status_code == 401  # only a signed handshake is answered
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT event_id FROM {SCHEMA}.inbox").fetchall()
    assert rows == [("Ev1",)]


# Printable ASCII without surrounding blanks: what an HTTP client can send at all.
header_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80
).map(str.strip)


@pytest.fixture
def garbage_url(dsn: str) -> Any:
    def ordering(payload: Any, headers: Any) -> Ordering | None:
        if isinstance(payload, dict) and "key" in payload:
            return Ordering(payload["key"], payload.get("v"))
        return None

    receiver = InboxReceiver([source(body_limit=256, ordering=ordering)], dsn=dsn, schema=SCHEMA)
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        yield client


# JSON documents whose ordering key and version are anything JSON can carry, lone surrogates and
# integers beyond 64 bits included: the ordering extractor's input is untrusted too.
ordered_bodies = st.fixed_dictionaries(
    {
        "key": st.one_of(st.text(max_size=20), st.integers(), st.none(), st.just("\ud800")),
        "v": st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.none(), st.just(2**70)),
    }
).map(lambda d: json.dumps(d).encode())


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    body=st.one_of(st.binary(max_size=400), st.text(max_size=300).map(str.encode), ordered_bodies),
    signature=st.one_of(st.none(), header_values),
    event_id=st.one_of(st.none(), header_values),
    sign_it=st.booleans(),
    path=st.sampled_from(["/webhooks/shop", "/webhooks/", "/webhooks/shop/x", "/webhooks/%00"]),
)
def test_garbage_deliveries_never_get_a_500(
    garbage_url: httpx.Client,
    body: bytes,
    signature: str | None,
    event_id: str | None,
    sign_it: bool,
    path: str,
) -> None:
    headers: dict[str, str] = {}
    if sign_it:
        headers = signed(body, event_id)
    else:
        if signature is not None:
            headers["x-signature"] = signature
        if event_id is not None:
            headers["x-event-id"] = event_id
    response = garbage_url.post(path, content=body, headers=headers)
    assert response.status_code < 500, response.text
    assert response.status_code in (200, 400, 401, 404, 409, 413)
    if response.status_code != 200:
        assert response.headers["content-type"] == "application/problem+json"


async def test_first_requests_open_the_pool_once_and_an_unreachable_database_is_503() -> None:
    # A port nobody listens on: the receiver cannot open its pool.
    dead = "postgresql://postgres@127.0.0.1:1/nothing?connect_timeout=1"
    receiver = InboxReceiver([source()], dsn=dead, schema=SCHEMA)
    receiver.pool.timeout = 1.0
    body = b"{}"
    headers = [(k.encode(), v.encode()) for k, v in signed(body, "e1").items()]
    answers: list[int] = []

    async def one() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        async def send(message: Any) -> None:
            if message["type"] == "http.response.start":
                answers.append(message["status"])

        scope = {"type": "http", "method": "POST", "path": "/webhooks/shop", "headers": headers}
        await receiver(scope, receive, send)

    started = time.monotonic()
    await asyncio.gather(one(), one(), one())
    assert answers == [503, 503, 503]
    assert time.monotonic() - started < 10  # one bounded wait, not one per request
    await receiver.close()


def test_mounted_in_another_app_with_the_body_hash_as_fallback_id(dsn: str) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    receiver = InboxReceiver([source()], dsn=dsn, schema=SCHEMA, prefix="")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with receiver:
            yield

    app = Starlette(routes=[Mount("/hooks", receiver)], lifespan=lifespan)
    body = b'{"no":"id header"}'
    with serve(app) as url, httpx.Client(base_url=url) as client:
        first = client.post("/hooks/shop", content=body, headers=signed(body, None))
        again = client.post("/hooks/shop", content=body, headers=signed(body, None))
        unknown = client.post("/hooks/none", content=body, headers=signed(body, None))
    assert [first.json()["outcome"], again.json()["outcome"]] == ["stored", "duplicate"]
    assert unknown.status_code == 404
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT event_id FROM {SCHEMA}.inbox").fetchone()
    assert row is not None
    assert row[0].startswith("sha256:")


async def test_a_delivery_the_database_refuses_fails_alone_not_its_batch(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A constraint of this test's own database stands for any row PostgreSQL might refuse.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"ALTER TABLE {SCHEMA}.inbox ADD CONSTRAINT no_poison CHECK (event_id <> 'poison')"
        )
    receiver = InboxReceiver([source()], dsn=dsn, schema=SCHEMA, flushers=1)
    answers: dict[str, int] = {}

    async def deliver(event_id: str, extra: list[tuple[bytes, bytes]] = []) -> None:  # noqa: B006
        body = json.dumps({"id": event_id}).encode()
        headers = [(k.encode(), v.encode()) for k, v in signed(body, event_id).items()]
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        async def send(message: Any) -> None:
            if message["type"] == "http.response.start":
                answers[event_id] = message["status"]

        scope = {"type": "http", "method": "POST", "path": "/webhooks/shop"}
        await receiver(scope | {"headers": headers + extra}, receive, send)

    async with receiver:
        ids = [f"e{i}" for i in range(20)]
        await asyncio.gather(
            *(deliver(i) for i in ids[:10]),
            deliver("poison"),
            deliver("nul", [(b"x-note", b"a\x00b")]),  # an ASGI server could pass this on
            *(deliver(i) for i in ids[10:]),
        )
    # All 22 shared one batch (one flusher, queued before it ran), which then fell apart.
    assert "a batch of 22 deliveries failed" in caplog.text
    assert answers.pop("poison") == 503
    assert answers == dict.fromkeys([*ids, "nul"], 200)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {SCHEMA}.inbox").fetchone() == (21,)


@pytest.mark.parametrize("original", ["rolls back", "commits"])
async def test_a_delivery_waits_for_an_uncommitted_original_and_answers_after_commit(
    dsn: str, original: str
) -> None:
    from pgonce.core.inbox import Delivery, digest
    from pgonce.store._async.inbox import AsyncInboxStore

    body = b'{"n":1}'
    receiver = InboxReceiver([source()], dsn=dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as holder:
        # Another transaction holds the same event, uncommitted (a batch being stored elsewhere).
        await holder.execute("BEGIN")
        first = Delivery("shop", "evt_1", body, {}, digest(body))
        assert await AsyncInboxStore(schema=SCHEMA).store(holder, [first]) == ["stored"]
        with serve(receiver) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                pending = asyncio.create_task(
                    client.post("/webhooks/shop", content=body, headers=signed(body, "evt_1"))
                )
                done, _ = await asyncio.wait([pending], timeout=0.5)
                assert not done  # no answer while the outcome is undecided
                await (holder.rollback() if original == "rolls back" else holder.commit())
                response = await asyncio.wait_for(pending, 10)
    expected = "stored" if original == "rolls back" else "duplicate"
    assert (response.status_code, response.json()["outcome"]) == (200, expected)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {SCHEMA}.inbox").fetchone() == (1,)
