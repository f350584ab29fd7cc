"""Two-phase payments against real processes: kill -9 at every boundary, and a paused zombie.

Each holder is a process of its own (faults/payer.py) charging through the fake provider
(pgonce.testing). After every crash, a retry takes the key over (its clock moved past the lease)
and finishes: the provider made exactly one charge for the payment, the database holds one
payment with that charge, and every client that asks again gets the same answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from faults.payer import POINTS
from pgonce.testing import FakeProvider

#: The lease is the default (30 s); a retry's clock is moved on past it.
AHEAD = "60"


@pytest.fixture
def payments_dsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE phase_payments (key text PRIMARY KEY, amount int, charge text)")
    return dsn


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with FakeProvider() as p:
        yield p


def holder(dsn: str, key: str, provider: FakeProvider, *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "faults.payer", dsn, key, provider.url, *options],
        stdout=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


def payment(dsn: str, key: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return c.execute(
            "SELECT amount, charge FROM phase_payments WHERE key = %s", (key,)
        ).fetchall()


@pytest.mark.parametrize("point", [*POINTS, "during-charge"])
def test_kill_9_at_every_boundary_charges_once_and_answers_the_same(
    payments_dsn: str, provider: FakeProvider, point: str
) -> None:
    key = f"pay-{point}"
    if point == "during-charge":
        # The provider charged and has not answered yet: the holder dies in the middle of the call.
        first = holder(payments_dsn, key, provider)
        provider.after_charge = lambda request: os.kill(first.pid, signal.SIGKILL)
    else:
        first = holder(payments_dsn, key, provider, "--crash", point)
    first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    provider.after_charge = None

    retry = finished(holder(payments_dsn, key, provider, "--ahead", AHEAD))
    expected = "replay" if point == "after-finish-commit" else "stored"
    assert retry["outcome"] == expected
    answer = json.loads(retry["answer"])
    again = [finished(holder(payments_dsn, key, provider, "--ahead", AHEAD)) for _ in range(2)]
    assert [a["outcome"] for a in again] == ["replay", "replay"]
    assert {a["answer"] for a in again} == {retry["answer"]}

    assert provider.charges_for(key) == 1
    assert payment(payments_dsn, key) == [(4200, answer["charge"])]


def test_a_paused_zombie_is_fenced_and_the_new_holders_answer_stands(
    payments_dsn: str, provider: FakeProvider
) -> None:
    zombie = holder(payments_dsn, "pay-zombie", provider, "--pause", "after-charge")
    assert zombie.stdout is not None
    assert zombie.stdout.readline().strip() == "paused"
    _, status = os.waitpid(zombie.pid, os.WUNTRACED)  # stopped, not merely about to stop
    assert os.WIFSTOPPED(status)
    try:
        # Past the zombie's lease: a retry takes over, is charged the same charge, and finishes.
        retry = finished(holder(payments_dsn, "pay-zombie", provider, "--ahead", AHEAD))
        assert retry["outcome"] == "stored"
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    woke = finished(zombie)
    assert woke["outcome"] == "lease_lost"

    answer = json.loads(retry["answer"])
    assert answer["holder"] != zombie.pid
    replay = finished(holder(payments_dsn, "pay-zombie", provider))
    assert replay == {"outcome": "replay", "answer": retry["answer"]}
    assert provider.charges_for("pay-zombie") == 1
    assert provider.requests == 2  # the zombie's call and the retry's, one charge
    assert payment(payments_dsn, "pay-zombie") == [(4200, answer["charge"])]
