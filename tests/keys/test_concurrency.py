"""Retry storms and crashes: exactly one effect per key, whatever happens around it.

Separate connections, separate processes, and SIGKILL: the guarantees must hold across all of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

from pgonce import AsyncKeyStore, InFlight, KeyStore, Replay, Response, Won
from tests.keys.worker import FP, deliver

ROOT = Path(__file__).resolve().parents[2]


def make_effects_table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL)")


def count_effects(dsn: str, key: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM effects WHERE key = %s", (key,)).fetchone()
        return int(row[0]) if row else -1


@pytest.mark.pooled
async def test_200_concurrent_claims_over_a_pool_give_one_effect(
    dsn: str, connect_kwargs: dict[str, Any]
) -> None:
    make_effects_table(dsn)
    store = AsyncKeyStore(wait=timedelta(milliseconds=200))
    async with AsyncConnectionPool(
        dsn, min_size=20, max_size=20, open=False, kwargs=connect_kwargs
    ) as pool:
        results = await asyncio.gather(*(deliver(pool, store, "k") for _ in range(200)))
    assert count_effects(dsn, "k") == 1
    assert sum(r["won"] for r in results) == 1
    assert len({r["body"] for r in results}) == 1


def test_200_concurrent_claims_across_processes_give_one_effect(dsn: str) -> None:
    make_effects_table(dsn)
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.keys.worker", "storm", dsn, "k", "50", "5"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results: list[dict[str, Any]] = []
    for process in processes:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0
        results.extend(json.loads(line) for line in out.splitlines())
    assert len(results) == 200
    assert count_effects(dsn, "k") == 1
    assert sum(r["won"] for r in results) == 1
    assert len({r["body"] for r in results}) == 1


@pytest.mark.parametrize("step", ["claimed", "written", "completed"])
def test_sigkill_at_each_step_frees_the_key(dsn: str, step: str) -> None:
    make_effects_table(dsn)
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.keys.worker", "crash", dsn, "k", step],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None
    for line in worker.stdout:
        if line.strip() == step:
            break
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=30)

    # PostgreSQL notices the dead client and rolls its transaction back; the retry waits for that
    # (bounded), then wins the key. Nothing half-done was ever visible.
    store = KeyStore(wait=timedelta(seconds=30))
    with psycopg.connect(dsn) as conn:
        claim = store.claim(conn, "crash", "k", FP)
        assert isinstance(claim, Won)
        assert count_effects(dsn, "k") == 0
        conn.execute("INSERT INTO effects (key) VALUES ('k')")
        store.complete(conn, claim, Response(201, (), b"done"))
        conn.commit()
        assert isinstance(store.claim(conn, "crash", "k", FP), Replay)
    assert count_effects(dsn, "k") == 1


# ---- property test: random interleavings against a model -----------------------------------

CONNS = 2
KEYS = ("a", "b")
Op = tuple[str, int, str]  # (action, connection, key)
ops = st.lists(
    st.tuples(
        st.sampled_from(["claim", "complete", "commit", "rollback"]),
        st.integers(0, CONNS - 1),
        st.sampled_from(KEYS),
    ),
    max_size=14,
)


class Model:
    """What the key store must answer, as plain Python."""

    def __init__(self) -> None:
        self.committed: dict[str, bool] = {}  # key -> completed?
        self.pending: list[dict[str, bool]] = [{} for _ in range(CONNS)]

    def claim(self, c: int, key: str) -> str:
        if key in self.pending[c]:
            return "replay" if self.pending[c][key] else "in_flight"
        if any(key in p for i, p in enumerate(self.pending) if i != c):
            return "in_flight"
        if key in self.committed:
            return "replay" if self.committed[key] else "in_flight"
        self.pending[c][key] = False
        return "won"

    def complete(self, c: int, key: str) -> bool:
        if self.pending[c].get(key) is False:
            self.pending[c][key] = True
            return True
        return False

    def end(self, c: int, commit: bool) -> None:
        if commit:
            self.committed.update(self.pending[c])
        self.pending[c] = {}


def kind(outcome: object) -> str:
    if isinstance(outcome, Won):
        return "won"
    if isinstance(outcome, Replay):
        return "replay"
    assert isinstance(outcome, InFlight)
    return "in_flight"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=ops)
def test_random_interleavings_match_the_model(dsn: str, steps: list[Op]) -> None:
    run = uuid.uuid4()  # fresh keys per example: examples share the test's database
    store = KeyStore(wait=timedelta(milliseconds=100))
    model = Model()
    wins: dict[tuple[int, str], Won] = {}
    conns = [psycopg.connect(dsn) for _ in range(CONNS)]
    try:
        for action, c, key in steps:
            scoped = f"{run}:{key}"
            if action == "claim":
                outcome = store.claim(conns[c], "prop", scoped, FP)
                assert kind(outcome) == model.claim(c, key), (action, c, key)
                if isinstance(outcome, Won):
                    wins[(c, key)] = outcome
            elif action == "complete":
                won = wins.get((c, key))
                if won is not None:
                    assert store.complete(conns[c], won, Response(200, (), b"x")) == model.complete(
                        c, key
                    )
            else:
                (conns[c].commit if action == "commit" else conns[c].rollback)()
                model.end(c, commit=action == "commit")
                wins = {k: v for k, v in wins.items() if k[0] != c}
    finally:
        for conn in conns:
            conn.close()
