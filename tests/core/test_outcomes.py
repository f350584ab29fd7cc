"""The pure decisions of a claim, without a database."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from pgonce.core.fingerprint import fingerprint
from pgonce.core.outcomes import (
    ClaimRow,
    InFlight,
    Replay,
    Response,
    Won,
    decide,
    validate_fingerprint,
    validate_key,
)
from pgonce.core.requests import request_fingerprint
from pgonce.errors import KeyMismatch, UsageError

T0 = datetime(2026, 1, 1, tzinfo=UTC)
FP = fingerprint("request")


def row(state: str, fp: bytes | None = FP, completed: bool = False) -> ClaimRow:
    return ClaimRow(
        state=state,
        fingerprint=fp,
        claimed_at=T0,
        completed_at=T0 if completed else None,
        status=201 if completed else None,
        headers=[["content-type", "text/plain"]] if completed else None,
        body=b"done" if completed else None,
    )


def test_won() -> None:
    assert decide(row("won"), scope="s", key="k", fingerprint=FP, retry_after=1) == Won(
        "s", "k", FP, T0
    )


def test_completed_same_fingerprint_replays_the_stored_response() -> None:
    outcome = decide(
        row("existing", completed=True), scope="s", key="k", fingerprint=FP, retry_after=1
    )
    assert isinstance(outcome, Replay)
    assert outcome.response == Response(201, (("content-type", "text/plain"),), b"done")


@pytest.mark.parametrize("completed", [True, False])
def test_other_fingerprint_is_a_mismatch_completed_or_not(completed: bool) -> None:
    with pytest.raises(KeyMismatch, match="different request"):
        decide(
            row("existing", fp=fingerprint("other"), completed=completed),
            scope="s",
            key="k",
            fingerprint=FP,
            retry_after=1,
        )


@pytest.mark.parametrize("state", ["locked", "invisible", "gone"])
def test_not_decidable_yet_is_in_flight(state: str) -> None:
    outcome = decide(row(state, fp=None), scope="s", key="k", fingerprint=FP, retry_after=3)
    assert outcome == InFlight(retry_after=3, reason=state)


def test_committed_without_response_is_in_flight() -> None:
    outcome = decide(row("existing"), scope="s", key="k", fingerprint=FP, retry_after=2)
    assert outcome == InFlight(retry_after=2, reason="incomplete")


def test_a_begin_claim_without_response_is_in_flight_though_born_with_completed_at() -> None:
    # begin() sets completed_at with the claim; only the stored headers say a response is there.
    born = ClaimRow("existing", FP, T0, T0, None, None, None)
    outcome = decide(born, scope="s", key="k", fingerprint=FP, retry_after=2)
    assert outcome == InFlight(retry_after=2, reason="incomplete")


def test_fingerprint_parts_are_length_prefixed() -> None:
    assert fingerprint("ab", "c") != fingerprint("a", "bc")
    assert fingerprint(b"x") == fingerprint("x")
    assert len(fingerprint()) == 32


@pytest.mark.parametrize(
    ("scope", "key", "message"),
    [
        ("", "k", "scope must not be empty"),
        ("s", "", "key must not be empty"),
        ("s", "k" * 513, "at most 512"),
        ("s", "a\x00b", "NUL"),
    ],
)
def test_bad_keys_are_refused(scope: str, key: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        validate_key(scope, key)


def test_a_fingerprint_is_32_bytes() -> None:
    with pytest.raises(UsageError, match="32 bytes"):
        validate_fingerprint(b"short")


def test_fingerprints_never_change_across_versions() -> None:
    # Stored keys carry fingerprints: a pgonce that computed them differently would answer 422
    # to every retry of a request stored by the previous version. These digests are pinned.
    assert fingerprint("POST", "/orders", b"", b"raw", b"{}").hex() == (
        "e1685f1d93c44efb14ed28b9d68035077951b49e01493dfae0c2942edd85e0be"
    )
    body = b'{"currency": "EUR", "amount": 10}'
    assert (
        request_fingerprint(
            "POST", "/payments", b"a=1", body, content_type="application/json"
        ).hex()
        == "47a949f9b085fe6d347025e99a6ce48bd9bbf3765248ca14ed7d71a4d760b678"
    )


def test_the_store_s_outcomes_are_the_same_objects_as_the_dataclasses_make() -> None:
    from dataclasses import FrozenInstanceError, replace

    from pgonce.core.outcomes import replay, won

    made = won("s", "k", FP, T0, b"\x00\x01")
    assert made == Won("s", "k", FP, T0, row=b"\x00\x01")
    assert (made.kind, made.row, hash(made)) == ("won", b"\x00\x01", hash(Won("s", "k", FP, T0)))
    assert repr(made) == repr(Won("s", "k", FP, T0))
    with pytest.raises(FrozenInstanceError):
        made.key = "other"  # type: ignore[misc]
    assert replace(made, key="k2") == Won("s", "k2", FP, T0)
    response = Response(201, (("a", "b"),), b"x")
    assert replay(response, T0, T0) == Replay(response, T0, T0)
    assert replay(response, T0, T0).kind == "replay"


@pytest.mark.parametrize(
    ("status", "headers", "body", "expected"),
    [
        (201, [["a", "b"], ["a", "c"]], b"x", Response(201, (("a", "b"), ("a", "c")), b"x")),
        (None, None, None, Response()),
        (
            200,
            [["n", 1], ("m", "v")],
            bytearray(b"y"),
            Response(200, (("n", "1"), ("m", "v")), b"y"),
        ),
        (204, [], memoryview(b""), Response(204)),
    ],
)
def test_a_stored_response_is_read_back_as_it_was_stored(
    status: int | None, headers: list[Any] | None, body: Any, expected: Response
) -> None:
    read = Response.from_stored(status, headers, body)
    assert read == expected
    assert type(read.body) is bytes
    assert all(type(pair) is tuple for pair in read.headers)
