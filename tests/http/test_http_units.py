"""The middleware's pure parts: key parsing, request fingerprints, replayed headers, routing.

And one in-process check of a promise the server tests cannot see: the middleware keeps no
per-request state on its instance.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from hypothesis import given
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel
from starlette.requests import Request

from examples.payments import app as payments
from pgonce.core.fingerprint import fingerprint
from pgonce.core.outcomes import Response
from pgonce.core.requests import canonical_json, is_json, request_fingerprint
from pgonce.errors import InvalidIdempotencyKey, UsageError
from pgonce.http import IdempotencyMiddleware, connection, header_scope, transaction_of
from pgonce.http.keys import MAX_KEY_LENGTH, key_from_headers, parse_key
from pgonce.http.middleware import _request_headers
from pgonce.http.replay import replay_headers, storable_pairs, storable_text_pairs
from pgonce.http.semantics import IdempotencyRules

# --- keys -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("abc", "abc"),
        ('"abc"', "abc"),
        ("  abc\t", "abc"),
        ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ('"a\\"b"', 'a"b'),
        ('"a\\\\b"', "a\\b"),
        ('"with space"', "with space"),
        ("k" * MAX_KEY_LENGTH, "k" * MAX_KEY_LENGTH),
        ('"' + "k" * MAX_KEY_LENGTH + '"', "k" * MAX_KEY_LENGTH),
    ],
)
def test_keys_that_parse(raw: str, key: str) -> None:
    assert parse_key(raw) == key


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "   ",
        '""',
        "k" * (MAX_KEY_LENGTH + 1),
        '"' + "k" * (MAX_KEY_LENGTH + 1) + '"',
        "a\x00b",
        "a\x1fb",
        "a\x7fb",
        "a\nb",
        "a\tb",
        "caf\xe9",
        '"abc',
        '"a\\bc"',
        '"abc"def',
        '"abc\\',
    ],
)
def test_keys_that_are_refused(raw: str) -> None:
    with pytest.raises(InvalidIdempotencyKey) as caught:
        parse_key(raw)
    assert caught.value.status == 400
    if raw.strip():
        assert raw.strip() not in str(caught.value)  # the message never quotes the value


def test_key_from_headers() -> None:
    assert key_from_headers([(b"content-type", b"application/json")]) is None
    assert key_from_headers([(b"idempotency-key", b'"k1"')]) == "k1"
    with pytest.raises(InvalidIdempotencyKey):
        key_from_headers([(b"idempotency-key", b"a"), (b"idempotency-key", b"a")])


@given(st.one_of(st.none(), st.text(alphabet=st.characters(max_codepoint=255), max_size=300)))
def test_a_joined_text_key_is_the_key_of_its_bytes(value: str | None) -> None:
    # WSGI and Django hand the field over as one latin-1 str: the same key, the same refusals.
    def outcome(parse: Any, raw: Any) -> Any:
        try:
            return parse(raw)
        except InvalidIdempotencyKey as error:
            return str(error)

    as_bytes = [value.encode("latin-1")] if value is not None else []
    assert outcome(IdempotencyRules.joined_key, value) == outcome(IdempotencyRules.key, as_bytes)


def test_one_pass_over_the_request_headers_keeps_the_first_of_a_repeated_header() -> None:
    headers = [
        (b"Content-Type", b"application/json"),
        (b"idempotency-key", b"k1"),
        (b"content-type", b"text/plain"),
        (b"Content-Length", b"12"),
        (b"content-length", b"99"),
        (b"Idempotency-Key", b"k2"),
    ]
    assert _request_headers(headers) == ([b"k1", b"k2"], "application/json", b"12")
    assert _request_headers([]) == ([], None, None)


# --- fingerprints ---------------------------------------------------------------------------------


def test_canonical_json_ignores_key_order_and_whitespace() -> None:
    a = canonical_json(b'{"b": [1, {"y": 2, "x": 1}], "a": "\\u00e9"}')
    b = canonical_json('{"a":"é","b":[1,{"x":1,"y":2}]}'.encode())
    assert a == b
    assert a == '{"a":"é","b":[1,{"x":1,"y":2}]}'.encode()


@pytest.mark.parametrize(
    "body",
    [
        '{"b": 1, "a": "é"}'.encode("utf-16"),  # with its byte order mark
        '{"b": 1, "a": "é"}'.encode("utf-32-le"),
        '{"b": 1, "a": "é"}'.encode("utf-8-sig"),
    ],
)
def test_canonical_json_reads_every_encoding_json_allows(body: bytes) -> None:
    """RFC 8259 bodies in UTF-16 or UTF-32, or behind a UTF-8 BOM: read as json.loads reads them."""
    assert canonical_json(body) == '{"a":"é","b":1}'.encode()


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (b'{"a": 1}', b'{"a": 1.0}'),  # numbers as written: never a rounding collision
        (b'{"a": 1}', b'{"a": "1"}'),
        (b"[1, 2]", b"[2, 1]"),  # array order matters
        (b'{"a": 10000000000000000001}', b'{"a": 10000000000000000000}'),
        (b'{"a": null}', b"{}"),
        (b'{"a": "\\ud800"}', b'{"a": "\\ud801"}'),  # lone surrogates: hashed, never sent
    ],
)
def test_canonical_json_keeps_every_difference_in_value(left: bytes, right: bytes) -> None:
    assert canonical_json(left) != canonical_json(right)


# Any text, lone surrogates included (JSON escapes them; json.dumps writes them as \\udXXX).
_SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
# Joined by hand: st.text() leaves surrogates out whatever its alphabet allows.
_TEXT = st.lists(st.characters(exclude_categories=()) | _SURROGATES, max_size=8).map("".join)
_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


@given(_JSON_VALUES)
def test_canonical_json_reads_any_json_and_ignores_its_layout(value: Any) -> None:
    """Any JSON document (lone surrogates included) has a canonical form, whatever its layout."""
    spread = json.dumps(value, indent=1).encode()  # ASCII: every surrogate escaped
    canonical = canonical_json(spread)
    assert canonical is not None
    assert canonical == canonical_json(json.dumps(value, separators=(",", ":")).encode())
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    if not any("\ud800" <= char <= "\udfff" for char in text):  # else not UTF-8
        assert canonical == canonical_json(text.encode())


def test_canonical_json_keeps_minus_zero_apart_from_zero() -> None:
    assert canonical_json(b"[-0]") == b"[-0]"
    assert canonical_json(b"[0]") == b"[0]"


@pytest.mark.parametrize(
    "body", [b"not json", b'{"a": 1, "a": 2}', b'{"a": NaN}', b"", b"{", b'{"a": "\xff"}']
)
def test_bodies_that_are_not_canonical_json(body: bytes) -> None:
    assert canonical_json(body) is None


@pytest.mark.parametrize(("open_", "close"), [(b"[", b"]"), (b'{"a":', b"}"), (b'[{"a":', b"}]")])
def test_a_document_nested_beyond_the_stack_is_hashed_as_bytes(open_: bytes, close: bytes) -> None:
    body = open_ * 100_000 + b"1" + close * 100_000
    assert canonical_json(body) is None
    assert fp(body=body) == fp(body=body, content_type="text/plain")


def test_is_json() -> None:
    assert is_json("application/json")
    assert is_json("Application/JSON; charset=utf-8")
    assert is_json("application/problem+json")
    assert not is_json("text/plain")
    assert not is_json("application/jsonp")
    assert not is_json(None)


def fp(**overrides: Any) -> bytes:
    parts: dict[str, Any] = {
        "method": "POST",
        "path": "/payments",
        "query": b"a=1",
        "body": b'{"amount": 1, "currency": "EUR"}',
        "content_type": "application/json",
    }
    parts.update(overrides)
    return request_fingerprint(
        parts.pop("method"), parts.pop("path"), parts.pop("query"), parts.pop("body"), **parts
    )


def test_the_fingerprint_covers_method_path_query_and_body() -> None:
    base = fp()
    assert fp() == base
    assert fp(method="post") == base
    assert fp(body=b'{ "currency": "EUR", "amount": 1 }') == base
    for changed in (
        fp(method="PATCH"),
        fp(path="/payments/"),
        fp(query=b"a=2"),
        fp(query=b""),
        fp(body=b'{"amount": 2, "currency": "EUR"}'),
    ):
        assert changed != base


@given(
    method=st.sampled_from(["POST", "patch", "PUT"]),
    path=st.text(max_size=20),
    query=st.binary(max_size=20),
    body=st.binary(max_size=40) | st.sampled_from([b'{"b": 1, "a": [2.50, "x"]}', b"[]"]),
    content_type=st.sampled_from([None, "application/json", "text/plain"]),
)
def test_the_request_fingerprint_is_the_fingerprint_of_its_parts(
    method: str, path: str, query: bytes, body: bytes, content_type: str | None
) -> None:
    # request_fingerprint() writes the framing out for speed; it must hash what fingerprint()
    # hashes, or stored keys would stop matching their retries.
    canonical = canonical_json(body) if is_json(content_type) else None
    tag, hashed = (b"raw", body) if canonical is None else (b"json", canonical)
    assert request_fingerprint(method, path, query, body, content_type=content_type) == fingerprint(
        method.upper(), path, query, tag, hashed
    )


def test_canonical_and_raw_bodies_never_collide() -> None:
    canonical = b'{"amount":1,"currency":"EUR"}'
    assert fp(body=canonical) != fp(body=canonical, content_type="text/plain")
    assert fp(body=b'{ "amount": 1 }', canonicalize_json=False) != fp(
        body=b'{"amount": 1}', canonicalize_json=False
    )


# --- replayed headers -----------------------------------------------------------------------------


def test_stored_headers_drop_cookies_hop_by_hop_and_recomputed_ones() -> None:
    raw = [
        (b"content-type", b"application/json"),
        (b"Set-Cookie", b"session=secret"),
        (b"location", b"/payments/1"),
        (b"content-length", b"12"),
        (b"date", b"Sun, 29 Nov 2026 12:00:00 GMT"),
        (b"connection", b"keep-alive"),
        (b"transfer-encoding", b"chunked"),
        (b"keep-alive", b"timeout=5"),
        (b"x-custom", b"1"),
        (b"x-custom", b"2"),
        (b"idempotent-replayed", b"true"),
        (b"idempotency-key-expires", b"Mon, 30 Nov 2026 12:00:00 GMT"),
    ]
    assert storable_pairs(raw) == [
        ("content-type", "application/json"),
        ("location", "/payments/1"),
        ("x-custom", "1"),
        ("x-custom", "2"),
    ]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["Content-Type", "set-cookie", "Location", "DATE", "x-a", "Upgrade"]),
            st.text(alphabet=st.characters(max_codepoint=255), max_size=20),
        ),
        max_size=8,
    )
)
def test_text_headers_are_stored_as_their_bytes_would_be(headers: list[tuple[str, str]]) -> None:
    raw = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    assert storable_text_pairs(headers) == storable_pairs(raw)


def test_replay_headers_recompute_length_and_mark_the_replay() -> None:
    stored = Response(201, (("location", "/p/1"), ("set-cookie", "s=1")), b"12345")
    headers = replay_headers(stored, [("idempotency-key-expires", "x")])
    assert headers == [
        (b"location", b"/p/1"),
        (b"content-length", b"5"),
        (b"idempotent-replayed", b"true"),
        (b"idempotency-key-expires", b"x"),
    ]


# --- routing and scopes ---------------------------------------------------------------------------


async def _app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not called")


def middleware(**options: Any) -> IdempotencyMiddleware:
    pool = AsyncConnectionPool("", open=False)
    return IdempotencyMiddleware(_app, pool=pool, key_scope=lambda scope: "s", **options)


def test_methods_per_route_by_longest_prefix_on_segment_boundaries() -> None:
    mw = middleware(routes={"/payments": ["post"], "/payments/refunds": [], "/admin/": ["PUT"]})
    assert mw.methods_for("/payments") == {"POST"}
    assert mw.methods_for("/payments/42") == {"POST"}
    assert mw.methods_for("/payments/refunds/1") == frozenset()
    assert mw.methods_for("/paymentsx") == {"POST", "PATCH"}  # not a segment of /payments
    assert mw.methods_for("/admin/users") == {"PUT"}
    assert mw.methods_for("/other") == {"POST", "PATCH"}
    assert middleware(methods=["post"]).methods_for("/x") == {"POST"}


def test_key_scope_is_required() -> None:
    pool = AsyncConnectionPool("", open=False)
    with pytest.raises(TypeError):
        IdempotencyMiddleware(_app, pool=pool)  # type: ignore[call-arg]
    with pytest.raises(UsageError):
        IdempotencyMiddleware(_app, pool=pool, key_scope="tenant")  # type: ignore[arg-type]


def test_a_wait_shorter_than_a_claim_may_take_is_refused_when_built() -> None:
    pool = AsyncConnectionPool("", open=False)
    with pytest.raises(UsageError, match="at least 100 ms"):
        IdempotencyMiddleware(
            _app, pool=pool, key_scope=lambda scope: "s", wait=timedelta(milliseconds=5)
        )
    built = IdempotencyMiddleware(_app, pool=pool, key_scope=lambda scope: "s", wait=None)
    assert built.store.wait == timedelta(milliseconds=100)  # what "no wait" means for a claim


def test_header_scope_hashes_the_credential() -> None:
    of = header_scope("X-Api-Key", prefix="key:")
    scope = {"headers": [(b"x-api-key", b"sk_live_secret")]}
    assert of(scope) == "key:" + hashlib.sha256(b"sk_live_secret").hexdigest()
    assert of({"headers": []}) is None


def test_a_request_without_a_claim_has_no_transaction() -> None:
    request = Request({"type": "http", "headers": [], "state": {}})
    with pytest.raises(UsageError):
        transaction_of(request)


# --- no per-request state on the instance ---------------------------------------------------------


def find_middleware(app: Any) -> IdempotencyMiddleware:
    layer = app.middleware_stack
    while not isinstance(layer, IdempotencyMiddleware):
        layer = layer.app
    return layer


async def test_the_middleware_keeps_no_per_request_state(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(payments.CREATE_TABLE)
    app = payments.create_app(dsn)
    pool = app.state.pool
    await pool.open()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"Authorization": "Bearer alice-token", "Idempotency-Key": "k1"}
            body = {"amount": 1, "currency": "EUR"}
            assert (await client.post("/payments", json=body, headers=headers)).status_code == 201
            mw = find_middleware(app)
            before = dict(vars(mw))
            answers = [
                await client.post("/payments", json=body, headers=headers),  # replay
                await client.post("/payments", json={**body, "amount": 2}, headers=headers),
                await client.post(
                    "/payments",
                    json=body,
                    headers={**headers, "Idempotency-Key": uuid.uuid4().hex},
                ),
                await client.post("/payments", json=body, headers={"Idempotency-Key": "k2"}),
            ]
            assert [a.status_code for a in answers] == [201, 422, 201, 401]
            assert dict(vars(mw)) == before
            assert all(vars(mw)[name] is value for name, value in before.items())
    finally:
        await pool.close()


# --- Starlette, an autocommit pool, an async key scope ----------------------------------------


async def test_starlette_helper_on_an_autocommit_pool_with_an_async_key_scope(dsn: str) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Route

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE notes (id serial PRIMARY KEY, text text)")

    async def create(request: Request) -> JSONResponse:
        cur = await connection(request).execute(
            "INSERT INTO notes (text) VALUES (%s) RETURNING id", ((await request.body()).decode(),)
        )
        row = await cur.fetchone()
        assert row is not None
        return JSONResponse({"id": row[0]}, status_code=201)

    async def tenant(scope: Any) -> str | None:
        return dict(scope["headers"]).get(b"x-tenant", b"").decode() or None

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, open=False, kwargs={"autocommit": True}, min_size=1, max_size=2
    )
    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/notes", create, methods=["POST"])]), pool=pool, key_scope=tenant
    )
    await pool.open()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"X-Tenant": "t1", "Idempotency-Key": "n1"}
            first = await client.post("/notes", content=b"hello", headers=headers)
            second = await client.post("/notes", content=b"hello", headers=headers)
            other = await client.post(
                "/notes", content=b"hello", headers={**headers, "X-Tenant": "t2"}
            )
    finally:
        await pool.close()
    assert first.status_code == second.status_code == other.status_code == 201
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in other.headers
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM notes").fetchone() == (2,)
        scopes = conn.execute("SELECT scope FROM pgonce.keys ORDER BY scope").fetchall()
        assert scopes == [("t1",), ("t2",)]


# --- FastAPI without a dependency: connection(request) ------------------------------------------


class _Note(BaseModel):
    text: str


def _notes_app(pool: AsyncConnectionPool[Any]) -> FastAPI:
    """An endpoint that takes the transaction through the request, not FastAPI's dependency."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, pool=pool, key_scope=lambda scope: "t1")

    @app.post("/notes", status_code=201)
    async def create(note: _Note, request: Request) -> JSONResponse:
        cur = await connection(request).execute(
            "INSERT INTO notes (text) VALUES (%s) RETURNING id", (note.text,)
        )
        row = await cur.fetchone()
        assert row is not None
        return JSONResponse({"id": row[0]}, status_code=201)

    return app


async def test_fastapi_endpoint_taking_the_connection_from_the_request(dsn: str) -> None:
    """The claim, the row and the response commit together; a validation error (produced before
    the endpoint began) is not stored, so the corrected retry with the same key runs."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE notes (id serial PRIMARY KEY, text text)")
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, open=False, min_size=1, max_size=2)
    await pool.open()
    try:
        transport = httpx.ASGITransport(app=_notes_app(pool))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"Idempotency-Key": "n1"}
            invalid = await client.post("/notes", json={"txt": "hello"}, headers=headers)
            fixed = await client.post("/notes", json={"text": "hello"}, headers=headers)
            again = await client.post("/notes", json={"text": "hello"}, headers=headers)
    finally:
        await pool.close()
    assert invalid.status_code == 422  # FastAPI's own, before the endpoint began
    assert "idempotent-replayed" not in invalid.headers
    assert fixed.status_code == again.status_code == 201, fixed.text
    assert again.content == fixed.content
    assert again.headers["idempotent-replayed"] == "true"
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM notes").fetchone() == (1,)
