"""Generated bad input (hypothesis) over real HTTP: to the service's webhook endpoint and to the
Idempotency-Key middleware of the example payments app.

Requests are written byte for byte on a socket of their own (no HTTP client library between), so
that control characters, CR/LF inside header values, non-UTF-8 bodies and lying lengths reach the
server as generated. Each generated case carries the statuses its kind is documented to get (the
README's tables, RFC 9110 for requests the HTTP parser refuses); the checks are: no 500, every
answer one of its documented statuses, and (checked at the end of the run) no traceback in the
processes' logs. Valid cases are mixed in, and their effects are accounted like everywhere else.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import secrets
import socket
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import psycopg
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from faults.context import Context
from faults.load import Accounting
from faults.proxy import free_port
from faults.report import Result
from pgonce.webhooks.schemes import build_scheme

#: The source's body limit and the middleware's request limit (both 1 MiB by default).
LIMIT = 1024 * 1024
#: Answers of the HTTP parser (uvicorn's h11) to a request it cannot parse: RFC 9110 400.
PARSER = frozenset({400})


@dataclass(frozen=True)
class Case:
    kind: str
    method: bytes
    path: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    expected: frozenset[int]
    #: A valid request whose effect is accounted: its event id, or its payment's identity
    #: (``principal:amount``).
    effect: str | None = None


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    per_kind: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    effects: set[str] = field(default_factory=set)
    reflected: int = 0
    bodies: list[bytes] = field(default_factory=list)


def send_raw(port: int, case: Case, timeout: float = 30) -> tuple[int, bytes, bytes]:
    """Write ``case`` on a fresh connection; return (status, raw head, body); 0: no answer."""
    head = [
        case.method + b" " + case.path + b" HTTP/1.1",
        b"host: 127.0.0.1",
        b"connection: close",
        *(name + b": " + value for name, value in case.headers),
    ]
    if not any(name.lower() == b"content-length" for name, _ in case.headers):
        head.append(b"content-length: " + str(len(case.body)).encode())
    data = b"\r\n".join(head) + b"\r\n\r\n" + case.body
    answer = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        # Refused early (413), the send may fail while the answer is there to read. No half-close
        # after sending: uvicorn takes the client's EOF for a disconnect.
        with contextlib.suppress(OSError):
            sock.sendall(data)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
    raw_head, _, body = bytes(answer).partition(b"\r\n\r\n")
    try:
        status = int(raw_head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        status = 0
    return status, raw_head, body


# -- strategies -----------------------------------------------------------------------------------

#: Any text, lone surrogates included: JSON escapes them (\\ud800), UTF-8 cannot carry them (a
#: middleware that hashed them strictly answered 500). Joined by hand: st.text() leaves them out.
any_text = st.lists(
    st.characters(exclude_categories=())
    | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=()),
    max_size=30,
).map("".join)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
#: C0 controls and DEL: what a header value may not carry (RFC 9110), and no key or event id.
control_text = st.text(
    st.characters(min_codepoint=0, max_codepoint=0x1F) | st.just("\x7f"), min_size=1, max_size=5
)


def _order_body(run: str, order: str, amount: int, extra: object) -> bytes:
    return json.dumps(
        {"type": "order.created", "data": {"run": run, "order": order, "amount": amount},
         "extra": extra}
    ).encode()  # fmt: skip


WEBHOOK_KINDS = [
    "valid", "duplicate", "conflict", "missing header", "bad signature", "wrong secret",
    "timestamp past", "timestamp future", "timestamp garbage", "non-UTF-8 body",
    "malformed JSON", "huge body", "unknown source", "wrong method", "header injection",
    "bad event id",
]  # fmt: skip


def webhook_cases(
    kind: str, secret: str, stored: tuple[bytes, dict[str, str]]
) -> st.SearchStrategy[Case]:
    scheme = build_scheme("standard-webhooks", [secret])
    stored_body, stored_headers = stored

    @st.composite
    def case(draw: st.DrawFn) -> Case:
        event_id = f"evt_fuzz_{uuid.uuid4().hex}"
        extra = draw(json_values)
        body = _order_body("fuzz", f"o-{event_id}", draw(st.integers(0, 2**31 - 1)), extra)
        path = b"/webhooks/shop"
        method = b"POST"
        expected = frozenset({401})
        effect = None
        now = datetime.now(UTC)
        headers = scheme.sign(body, event_id=event_id, timestamp=now)
        if kind == "valid":
            expected, effect = frozenset({200}), event_id
        elif kind == "duplicate":
            body, headers, expected = stored_body, dict(stored_headers), frozenset({200})
        elif kind == "conflict":
            headers = scheme.sign(body, event_id=stored_headers["webhook-id"], timestamp=now)
            expected = frozenset({409})
        elif kind == "missing header":
            for name in draw(st.sets(st.sampled_from(sorted(headers)), min_size=1)):
                del headers[name]
        elif kind == "bad signature":
            headers["webhook-signature"] = draw(
                st.sampled_from(["v1,", "v1a,", ""])
                | st.builds(lambda b: "v1," + base64.b64encode(b).decode(), st.binary(max_size=40))
                | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)
            )
        elif kind == "wrong secret":
            other = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
            headers = build_scheme("standard-webhooks", [other]).sign(body, event_id=event_id)
        elif kind in ("timestamp past", "timestamp future"):
            skew = timedelta(seconds=draw(st.integers(5 * 60 + 30, 20 * 365 * 86400)))
            when = now - skew if kind == "timestamp past" else now + skew
            headers = scheme.sign(body, event_id=event_id, timestamp=when)
        elif kind == "timestamp garbage":
            headers["webhook-timestamp"] = draw(
                st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)
            )
        elif kind == "non-UTF-8 body":
            body = draw(st.binary(min_size=1, max_size=200)) + b"\xff\xfe"
            headers = scheme.sign(body, event_id=event_id, timestamp=now)
            expected = frozenset({400})
        elif kind == "malformed JSON":
            body = draw(
                # (Any JSON document is accepted, an array or a number too: documented.)
                st.sampled_from([b"{", b"[1,", b"nul", b"{'a': 1}", b"", b'{"a": 1}}'])
                | st.text(max_size=100).map(lambda t: ("{{" + t).encode())
            )
            headers = scheme.sign(body, event_id=event_id, timestamp=now)
            expected = frozenset({400})
        elif kind == "huge body":
            body = b'{"a": "' + b"x" * (LIMIT + draw(st.integers(1, 65536))) + b'"}'
            if draw(st.booleans()):
                headers = scheme.sign(body, event_id=event_id, timestamp=now)
            expected = frozenset({413})
        elif kind == "unknown source":
            path = (
                b"/webhooks/" + draw(st.from_regex(r"[a-z0-9_.~-]{0,30}", fullmatch=True)).encode()
            )
            if path == b"/webhooks/shop":
                path = b"/webhooks/shop2"
            expected = frozenset({404})
        elif kind == "wrong method":
            method = draw(st.sampled_from([b"GET", b"PUT", b"DELETE", b"PATCH"]))
            expected = frozenset({405})
        elif kind == "header injection":
            name = draw(st.sampled_from(["webhook-id", "webhook-signature", "webhook-timestamp"]))
            injected = draw(
                st.sampled_from(["\r\nx-injected: 1", "\nx-injected: 1", "\r\n\r\n"])
                | control_text
                | st.text(st.sampled_from("\u0085\u2028\u00ff"), min_size=1, max_size=3)
            )
            headers[name] = headers[name] + injected
            # The parser refuses it (400); or it parses into separate header lines, and then the
            # signed headers are intact (200: the extra line is just another header) or cut off
            # (401). The injected line must never come back in an answer.
            expected, effect = PARSER | {200, 401}, event_id
        elif kind == "bad event id":
            bad = draw(st.builds(lambda c: f"evt_{c}", control_text) | st.just("e" * 600))
            headers = scheme.sign(body, event_id=bad, timestamp=now)
            # Refused by the parser or the event id check (400); or, where the parser trimmed
            # trailing whitespace of the id, by the signature that covered it (401).
            expected = PARSER | {400, 401}
        raw = (
            *((k.encode(), v.encode("latin-1", "replace")) for k, v in headers.items()),
            (b"content-type", b"application/json"),
        )
        return Case(kind, method, path, raw, body, expected, effect)

    return case()


#: Payment amounts, one per generated request of the whole run.
_AMOUNTS = itertools.count()

MIDDLEWARE_KINDS = [
    "valid", "replay", "mismatch", "missing key", "oversize key", "control characters in key",
    "non-ASCII key", "empty key", "two keys", "broken sf-string", "no credentials",
    "malformed JSON", "non-UTF-8 body", "invalid payment", "non-finite JSON numbers", "huge body",
    "header injection",
]  # fmt: skip


def middleware_cases(kind: str, stored_key: str, stored_body: bytes) -> st.SearchStrategy[Case]:

    @st.composite
    def case(draw: st.DrawFn) -> Case:
        # Unique per case (hypothesis repeats small values): the amount names the payment.
        amount = 10_000_000 + next(_AMOUNTS)
        key = f'"fuzz-{uuid.uuid4().hex}"'.encode()
        body = json.dumps({"amount": amount, "currency": "EUR"}).encode()
        principal = draw(st.sampled_from(["alice", "bob"]))
        auth = f"Bearer {principal}-token".encode()
        #: The payment this request makes, if it makes one: who pays, and the unique amount.
        identity = f"{principal}:{amount}"
        # A header of no meaning, so that every kind has endless distinct examples.
        noise = draw(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20))
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"x-request-id", noise.encode() or b"-"),
        ]
        expected = frozenset({400})
        effect = None
        if kind == "valid":
            expected, effect = frozenset({201}), identity
        elif kind == "replay":
            key, body, auth, expected = (
                stored_key.encode(),
                stored_body,
                b"Bearer alice-token",
                frozenset({201}),
            )
        elif kind == "mismatch":
            key, auth, expected = stored_key.encode(), b"Bearer alice-token", frozenset({422})
        elif kind == "missing key":
            key = b""
        elif kind == "oversize key":
            key = b'"' + b"k" * draw(st.integers(256, 20_000)) + b'"'
        elif kind == "control characters in key":
            # A line break followed by a space or tab is obs-fold, which HTTP/1.1 lets the server
            # read as one space (RFC 9112, section 5.2; h11 does): '"\n\tk"' arrives as the
            # valid key " k". Line breaks are the header-injection kind's business.
            control = draw(control_text.filter(lambda text: not ({"\r", "\n"} & set(text))))
            key = ('"' + control + "k" + '"').encode("latin-1")
            expected = PARSER
        elif kind == "non-ASCII key":
            high = st.characters(min_codepoint=0x80, max_codepoint=0xFF)
            key = ('"k' + draw(st.text(high, min_size=1, max_size=10)) + '"').encode("latin-1")
        elif kind == "empty key":
            key = draw(st.sampled_from([b'""', b" "]))
        elif kind == "two keys":
            headers.append((b"idempotency-key", b'"fuzz-other"'))
        elif kind == "broken sf-string":
            # (A value without a leading quote is a bare key, documented: ``abc"`` is a key.)
            key = draw(st.sampled_from([b'"abc', b'"a"b"', b'"a\\', b'"a\\x"', b'" "x']))
        elif kind == "no credentials":
            auth = draw(st.sampled_from([b"", b"Bearer nobody", b"Basic YWxpY2U6eA=="]))
            expected = frozenset({401})
        elif kind == "malformed JSON":
            body = draw(
                st.sampled_from([b"{", b"{'amount': 1}", b"[", b"nul"])
                | st.text(max_size=50).map(lambda t: ("{{" + t).encode())
            )
            expected = frozenset({422})
        elif kind == "non-UTF-8 body":
            body = b'{"amount": 1, "currency": "\xff\xfe"}'
            expected = frozenset({400, 422})
        elif kind == "invalid payment":
            fields = st.fixed_dictionaries({"amount": json_values, "currency": json_values})
            body = json.dumps(draw(fields)).encode()
            expected = frozenset({422})
        elif kind == "non-finite JSON numbers":
            # Python's json (and so the middleware's canonical form and FastAPI) reads NaN and
            # Infinity, which JSON does not have; the request is invalid either way.
            bad = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity"]))
            template = draw(
                st.sampled_from(
                    [b'{"amount": %s, "currency": "EUR"}', b'{"amount": 1, "currency": %s}']
                )
            )
            body = template % bad
            expected = frozenset({400, 422})
        elif kind == "huge body":
            body = (
                b'{"amount": 1, "currency": "'
                + b"x" * (LIMIT + draw(st.integers(1, 65536)))
                + b'"}'
            )
            expected = frozenset({413})
        elif kind == "header injection":
            effect = identity
            key = key + draw(
                st.sampled_from([b"\r\nx-injected: 1", b"\nx-injected: 1", b"\r\n\r\n"])
            )
            # Parsed as two header lines the request is valid (201); refused by the parser (400);
            # or, with a blank line injected, cut before its credentials (401). The injected
            # line must never come back.
            expected = PARSER | {201, 401}
        if key:
            headers.append((b"idempotency-key", key))
        if auth:
            headers.append((b"authorization", auth))
        return Case(kind, b"POST", b"/payments", tuple(headers), body, expected, effect)

    return case()


#: The payment the replay and mismatch kinds refer to: alice's, of amount 5.
STORED_PAYMENT = "alice:5"


def fire(
    port: int,
    cases: Callable[[str], st.SearchStrategy[Case]],
    kinds: list[str],
    examples: int,
    seed: int,
    tally: Tally,
) -> None:
    """``examples`` cases, spread evenly over ``kinds`` (hypothesis alone would favour some)."""
    for i, kind in enumerate(kinds):
        share = examples // len(kinds) + (1 if i < examples % len(kinds) else 0)
        fire_kind(port, cases(kind), share, seed, tally)


def fire_kind(
    port: int, cases: st.SearchStrategy[Case], examples: int, seed: int, tally: Tally
) -> None:
    """Send ``examples`` generated cases (no shrinking: every case is tallied, none raises)."""

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(cases)
    def one(case: Case) -> None:
        status, head, body = send_raw(port, case)
        tally.statuses[str(status)] += 1
        tally.per_kind[case.kind] += 1
        if status not in case.expected:
            tally.unexpected[f"{case.kind} → {status}"] += 1
            tally.examples.setdefault(f"{case.kind} → {status}", repr(body[:200]))
        elif case.effect is not None and status in (200, 201):
            tally.effects.add(case.effect)
        if b"x-injected" in head.lower():
            tally.reflected += 1
        if status >= 400:
            tally.bodies.append(body)

    one()


def _result(name: str, target: str, tally: Tally, examples: int, kinds: list[str]) -> Result:
    result = Result(
        name,
        f"{examples} generated requests over raw HTTP to {target}, {len(kinds)} kinds (requests "
        "of each): " + ", ".join(f"{kind} {tally.per_kind[kind]}" for kind in kinds),
        "hostile and malformed input (hypothesis, no shrinking)",
    )
    sent = sum(tally.per_kind.values())
    result.acc = Accounting(sent=sent, statuses=tally.statuses)
    result.check(f"{sent} requests sent (at least {examples})", sent >= examples)
    # Half of the valid kind's share: what proves that valid requests got through at all.
    minimum = max(1, examples // len(kinds) // 2)
    result.check(
        f"at least {minimum} valid requests accepted among them ({len(tally.effects)})",
        len(tally.effects) >= minimum,
    )
    result.check(
        "every answer had its documented status"
        + (
            ""
            if not tally.unexpected
            else ": unexpected " + "; ".join(
                f"{k} ×{n} (body {tally.examples[k]})" for k, n in tally.unexpected.most_common(6)
            )
        ),
        not tally.unexpected,
    )  # fmt: skip
    result.check("no injected header came back in an answer", tally.reflected == 0)
    return result


async def bad_webhooks(ctx: Context) -> Result:
    examples = ctx.size(6000, 300)
    dsn = ctx.database("fuzz_webhooks")
    port = free_port()
    scheme = ctx.scheme
    stored_body = _order_body("fuzz", "o-stored", 1, None)
    stored = (stored_body, {**scheme.sign(stored_body, event_id="evt_fuzz_stored")})
    tally = Tally()
    with ctx.processes() as procs:
        procs.service("fuzz-service", dsn, port)
        ctx.keep_logs(procs)
        first = send_raw(port, Case("setup", b"POST", b"/webhooks/shop",
                                    tuple((k.encode(), v.encode()) for k, v in stored[1].items()),
                                    stored_body, frozenset({200})))  # fmt: skip
        if first[0] != 200:
            raise RuntimeError(f"the stored event was answered {first[0]}")
        await asyncio.to_thread(
            fire, port, lambda kind: webhook_cases(kind, ctx.secrets.shop, stored),
            WEBHOOK_KINDS, examples, ctx.seed, tally,
        )  # fmt: skip
        expected = {f"o-{e}" for e in tally.effects} | {"o-stored"}
        rows: dict[str, int] = {}
        for _ in range(300):
            rows = await asyncio.to_thread(_orders, dsn)
            if expected <= rows.keys():
                break
            await asyncio.sleep(0.2)
    ctx.bodies.extend(tally.bodies)
    result = _result(
        "bad input: webhook endpoint", "`pgonce serve`", tally, examples, WEBHOOK_KINDS
    )
    result.acc.acknowledged = len(expected)
    result.acc.effects = len(rows)
    result.acc.lost = len(expected - rows.keys())
    result.acc.doubled = sum(c - 1 for c in rows.values())
    result.acc.notes.append(
        f"valid and duplicate deliveries mixed in: {len(expected)} events acknowledged, "
        "each handled once; every other delivery left no row"
    )
    result.check("only acknowledged events left an effect", rows.keys() <= expected)
    return result


def _orders(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT order_ref, count(*) FROM pgonce_demo.webhook_orders GROUP BY order_ref"
        ).fetchall()
    return {str(r): int(c) for r, c in rows}


async def bad_requests(ctx: Context) -> Result:
    examples = ctx.size(4000, 200)
    dsn = ctx.database("fuzz_http")
    port = free_port()
    stored_key = '"fuzz-stored"'
    stored_body = json.dumps({"amount": 5, "currency": "EUR"}).encode()
    tally = Tally()
    with ctx.processes() as procs:
        procs.payments("fuzz-payments", dsn, port)
        ctx.keep_logs(procs)
        setup = Case("setup", b"POST", b"/payments", (
            (b"content-type", b"application/json"), (b"idempotency-key", stored_key.encode()),
            (b"authorization", b"Bearer alice-token")), stored_body, frozenset({201}))  # fmt: skip
        if send_raw(port, setup)[0] != 201:
            raise RuntimeError("the stored payment was not created")
        await asyncio.to_thread(
            fire, port, lambda kind: middleware_cases(kind, stored_key, stored_body),
            MIDDLEWARE_KINDS, examples, ctx.seed, tally,
        )  # fmt: skip
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT principal, amount, count(*) FROM payments GROUP BY 1, 2")
        made = {f"{principal}:{amount}": int(n) for principal, amount, n in rows}
    ctx.bodies.extend(tally.bodies)
    result = _result("bad input: Idempotency-Key middleware", "the payments app", tally, examples,
                     MIDDLEWARE_KINDS)  # fmt: skip
    # Matched by identity, never by totals: a lost payment and a stray one must not cancel out.
    # The stored payment, the valid ones, and injections that parsed into a valid request.
    acknowledged = tally.effects | {STORED_PAYMENT}
    stray = made.keys() - acknowledged
    result.acc.acknowledged = len(acknowledged)
    result.acc.effects = len(made.keys() & acknowledged)
    result.acc.doubled = sum(n - 1 for n in made.values())
    result.acc.lost = len(acknowledged - made.keys())
    result.check(
        f"every payment made was acknowledged with a 201 first answer: none for a refused "
        f"request ({len(stray)} stray" + (f": {', '.join(sorted(stray)[:5])}" if stray else "")
        + ")",
        not stray,
    )  # fmt: skip
    return result
