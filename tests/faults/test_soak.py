"""The soak's short form in the suite: every phase (baseline, idle-in-tx, high-load,
active-readers, pg-backend-kill, pool-exhaustion, recovery) for a few seconds each, at a fixed
offered rate, on the fault suite's own PostgreSQL and redis-server. It must lose nothing, double
nothing and answer no 500 in any phase, and every phase must have done what it says (a
transaction held, scans, kills, 300 connections held); the timing targets are the report's
(`make soak`), not this test's: a shared machine's noise would decide them.
"""

from __future__ import annotations

from faults.context import Context
from faults.soak.scenario import DEFAULT_PHASES, PROFILES, QUICK_RATE, QUICK_SECONDS, soak
from tests.faults.test_faults import explain

PHASE_SECONDS = QUICK_SECONDS


async def test_every_phase_loses_nothing_doubles_nothing_and_answers_no_500(ctx: Context) -> None:
    run = await soak(ctx, PROFILES["short"], DEFAULT_PHASES, seconds=PHASE_SECONDS, rate=QUICK_RATE)
    result = run.result
    assert result.error is None, explain(result, ctx)
    assert (result.acc.lost, result.acc.doubled, result.acc.http_500) == (0, 0, 0), explain(
        result, ctx
    )
    assert result.passed, explain(result, ctx)
    assert [r.phase.name for r in run.phases] == DEFAULT_PHASES
    for phase in run.phases:
        assert phase.ended > phase.began
        pgonce = ("payments", "webhooks", "inbox", "outbox")
        assert all(phase.lost[p] == 0 and phase.doubled[p] == 0 for p in pgonce), phase.label
        assert all(phase.completed[p] > 0 for p in pgonce), (phase.label, phase.completed)
    # The sampler read the database through the whole run.
    assert len(run.samples) >= len(DEFAULT_PHASES) * PHASE_SECONDS / 2
