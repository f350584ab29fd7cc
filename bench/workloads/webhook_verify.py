"""Signature verification per scheme, against a bare HMAC-SHA256 of the same body.

The reference is the least any verifier must do: one ``hmac.new(key, body, sha256).digest()``.
Each scheme's figure includes everything ``verify`` does (header parsing, decoding, constant-time
comparison, the tolerance check), so the ratio is the price of doing it safely. Ed25519 (Standard
Webhooks v1a) is a public-key signature and is expected to cost far more than any HMAC.
No database is involved.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench.context import BenchContext
from bench.report import Table, ratio
from pgonce.webhooks.schemes import SigningScheme, build_scheme

TITLE = "Webhook signature verification"

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SIZES = (1024, 16 * 1024)


def _body(size: int) -> bytes:
    filler = "x" * max(0, size - 60)
    return json.dumps({"id": "evt_1", "event_id": "Ev1", "data": filler}).encode()


def _schemes() -> list[tuple[str, SigningScheme]]:
    seed = Ed25519PrivateKey.generate().private_bytes_raw()
    whsk = "whsk_" + base64.b64encode(seed).decode()
    return [
        ("standard-webhooks v1", build_scheme("standard-webhooks", ["whsec_" + "A" * 32])),
        ("standard-webhooks v1a (Ed25519)", build_scheme("standard-webhooks", [whsk])),
        ("stripe", build_scheme("stripe", ["whsec_test_secret"])),
        ("github", build_scheme("github", ["It's a Secret to Everybody"])),
        ("shopify", build_scheme("shopify", ["shpss_secret"])),
        ("slack", build_scheme("slack", ["8f742231b10e8888abcd99yyyzzz85a5"])),
        (
            "generic-hmac (sha256, base64)",
            build_scheme("generic-hmac", ["k"], options={"header": "x-sig", "encoding": "base64"}),
        ),
    ]


def _bare_hmac(key: bytes, body: bytes) -> Callable[[], object]:
    return lambda: hmac.new(key, body, hashlib.sha256).digest()


def _verification(scheme: SigningScheme, body: bytes) -> Callable[[], object]:
    headers = scheme.sign(body, event_id="msg_1", timestamp=NOW)
    scheme.verify(headers, body, now=NOW)  # fails loudly if the set-up is wrong
    return lambda: scheme.verify(headers, body, now=NOW)


def _paired(
    reference: Callable[[], object], measured: Callable[[], object], seconds: float
) -> tuple[float, float]:
    """Calls per second of both, measured in alternating slices of 50 ms.

    Other work on the machine then slows both alike, so their ratio stays meaningful even when
    the absolute figures wander.
    """
    counts = [0, 0]
    spent = [0.0, 0.0]
    calls = (reference, measured)
    while sum(spent) < 2 * seconds:
        for which, call in enumerate(calls):
            started = time.perf_counter()
            deadline = started + 0.05
            done = 0
            while True:
                for _ in range(100):
                    call()
                done += 100
                now = time.perf_counter()
                if now >= deadline:
                    break
            counts[which] += done
            spent[which] += now - started
    return counts[0] / spent[0], counts[1] / spent[1]


def run(ctx: BenchContext) -> list[Table]:
    seconds = ctx.seconds(2.0)
    table = Table(
        TITLE,
        ["scheme", "body", "verifications/s", "bare HMAC-SHA256/s", "vs bare HMAC-SHA256"],
        notes=[
            "Reference: `hmac.new(key, body, hashlib.sha256).digest()` of the same body, "
            "measured in the same run in alternating 50 ms slices with each scheme; one active "
            "secret per scheme; everything `verify` does is counted (parsing, decoding, "
            "constant-time comparison, tolerance).",
            'Reproduce: `make bench BENCH_ARGS="--only webhook_verify"`.',
        ],
    )
    key = b"reference key of 24 bytes"
    for size in SIZES:
        body = _body(size)
        for label, scheme in _schemes():
            reference, rate = _paired(_bare_hmac(key, body), _verification(scheme, body), seconds)
            table.add(
                label,
                f"{size // 1024} KiB",
                f"{rate:,.0f}",
                f"{reference:,.0f}",
                ratio(rate, reference, "bare HMAC"),
            )
    return [table]
