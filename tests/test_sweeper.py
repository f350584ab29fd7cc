"""The sweeper on real PostgreSQL: batches, endings, what it must never delete, and concurrency.

The clock is a parameter: rows are written with old timestamps and the sweep is told ``now``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pty
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from pgonce.core.outcomes import Won
from pgonce.core.retention import TARGETS, Retention, RetentionPolicy, SweepLimits, SweepResult
from pgonce.errors import ConfigError, DatabaseError, UsageError
from pgonce.service.metrics import ServiceMetrics
from pgonce.sql import parse_named
from pgonce.store._async.sweeper import AsyncSweeper as AnyAsyncSweeper
from pgonce.store._async.sweeper import sweep_every
from pgonce.store._sync.keys import KeyStore
from pgonce.store._sync.sweeper import Sweeper as AnySweeper
from pgonce.store._sync.sweeper import sweep_every as sync_sweep_every
from tests.test_cli import pgonce

# These tests are about the key store's rows; the other targets (inbox, outbox) have their own.
Sweeper = functools.partial(AnySweeper, targets=["keys"])
AsyncSweeper = functools.partial(AnyAsyncSweeper, targets=["keys"])

NOW = datetime(2026, 6, 1, tzinfo=UTC)
DAY = timedelta(days=1)
NO_PAUSE = timedelta(0)


def add_keys(
    dsn: str,
    count: int,
    *,
    age: timedelta,
    scope: str = "api",
    completed: bool = True,
    completed_age: timedelta | None = None,
    prefix: str = "k",
) -> None:
    """``count`` keys claimed ``age`` before NOW, completed (``completed_age`` before NOW, by
    default at once) or still in flight."""
    claimed_at = NOW - age
    completed_at = NOW - (age if completed_age is None else completed_age)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            """INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at,
                                       response_status)
               SELECT %(scope)s, %(prefix)s || g, sha256(g::text::bytea), %(claimed_at)s,
                      CASE WHEN %(completed)s THEN %(completed_at)s END,
                      CASE WHEN %(completed)s THEN 200 END
                 FROM generate_series(1, %(count)s) AS g""",
            {
                "scope": scope,
                "prefix": prefix,
                "claimed_at": claimed_at,
                "completed_at": completed_at,
                "completed": completed,
                "count": count,
            },
        )


def remaining(dsn: str, where: str = "true") -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM pgonce.keys WHERE {where}").fetchone()
    assert row is not None
    return int(row[0])


def sweep(dsn: str, sweeper: AnySweeper, batches: list[int] | None = None) -> SweepResult:
    """One run at NOW on a connection of its own; ``batches`` collects each batch's count."""

    def on_batch(_target: str, deleted: int) -> None:
        if batches is not None:
            batches.append(deleted)

    with psycopg.connect(dsn, autocommit=True) as conn:
        return sweeper.sweep(conn, now=NOW, on_batch=on_batch)


@pytest.fixture(params=[True, False], ids=["ctid", "portable"])
def by_ctid(request: pytest.FixtureRequest) -> bool:
    """Both paths of every batch test: joined on ctid (plain PostgreSQL) and the portable one."""
    return bool(request.param)


def limits(batch_size: int, max_batches: int = 1000) -> SweepLimits:
    return SweepLimits(batch_size=batch_size, max_batches=max_batches, pause=NO_PAUSE)


def test_batches_of_batch_size_until_the_first_short_one(dsn: str, by_ctid: bool) -> None:
    add_keys(dsn, 25, age=40 * DAY)
    batches: list[int] = []
    result = sweep(dsn, Sweeper(ctid=by_ctid, limits=limits(10)), batches)
    assert batches == [10, 10, 5]
    (keys,) = result.targets
    assert (keys.deleted, keys.batches, keys.ending, keys.by_ctid) == (25, 3, "drained", by_ctid)
    assert remaining(dsn) == 0


def test_an_exact_multiple_ends_on_an_empty_batch(dsn: str, by_ctid: bool) -> None:
    add_keys(dsn, 20, age=40 * DAY)
    batches: list[int] = []
    sweep(dsn, Sweeper(ctid=by_ctid, limits=limits(10)), batches)
    assert batches == [10, 10, 0]


def test_the_cap_ends_a_run_and_the_next_run_continues(dsn: str, by_ctid: bool) -> None:
    add_keys(dsn, 50, age=40 * DAY)
    sweeper = Sweeper(ctid=by_ctid, limits=limits(10, max_batches=2))
    first = sweep(dsn, sweeper)
    assert (first.deleted, first.batches, first.capped) == (20, 2, True)
    assert "batch cap reached" in first.summary()
    assert remaining(dsn) == 30
    assert sweep(dsn, sweeper).deleted == 20
    last = sweep(dsn, sweeper)
    assert (last.deleted, last.capped) == (10, False)
    assert remaining(dsn) == 0


def test_only_completed_keys_past_their_retention_go(dsn: str, by_ctid: bool) -> None:
    add_keys(dsn, 5, age=40 * DAY, prefix="old-done-")
    add_keys(dsn, 3, age=400 * DAY, completed=False, prefix="old-in-flight-")
    add_keys(dsn, 4, age=29 * DAY, prefix="young-done-")
    add_keys(dsn, 2, age=31 * DAY, prefix="just-expired-")
    result = sweep(dsn, Sweeper(ctid=by_ctid, limits=limits(100)))
    assert result.deleted == 7
    assert remaining(dsn, "key LIKE 'old-in-flight-%'") == 3
    assert remaining(dsn, "key LIKE 'young-done-%'") == 4
    assert remaining(dsn) == 7


def test_retention_counts_from_the_completion(dsn: str, by_ctid: bool) -> None:
    # A key answered long after its claim (a bare claim() or a two-phase request) is kept for its
    # retention after the answer; the sweep notes the completion time it deleted.
    add_keys(dsn, 2, age=40 * DAY, completed_age=29 * DAY, prefix="late-")
    add_keys(dsn, 3, age=40 * DAY, completed_age=31 * DAY, prefix="due-")
    assert sweep(dsn, Sweeper(ctid=by_ctid, limits=limits(100))).deleted == 3
    assert remaining(dsn, "key LIKE 'late-%'") == remaining(dsn) == 2
    with psycopg.connect(dsn, autocommit=True) as conn:
        newest = conn.execute(
            "SELECT newest FROM pgonce.sweep_marks WHERE target = 'keys' AND scope = 'api'"
        ).fetchone()
    assert newest == (NOW - 31 * DAY,)


def test_an_open_claim_in_another_transaction_is_untouched(
    dsn: str, by_ctid: bool, store: KeyStore
) -> None:
    # A claim whose transaction is still open, made 40 days "ago": invisible to the sweeper, and
    # completed afterwards, it is a live key that must survive.
    add_keys(dsn, 3, age=40 * DAY)
    with psycopg.connect(dsn) as holder:
        won = store.claim(holder, "api", "open", b"\x01" * 32, now=NOW - 40 * DAY)
        assert isinstance(won, Won)
        assert sweep(dsn, Sweeper(ctid=by_ctid, limits=limits(10))).deleted == 3
        store.complete(holder, won)
        holder.commit()
    assert remaining(dsn, "key = 'open' AND completed_at IS NOT NULL") == 1


def test_a_locked_row_is_skipped_not_waited_for(dsn: str, by_ctid: bool) -> None:
    add_keys(dsn, 30, age=40 * DAY)
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM pgonce.keys WHERE key = 'k7' FOR UPDATE")
        started = time.monotonic()
        # A timeout shorter than any wait would turn a lock wait into an error.
        sweeper = Sweeper(
            ctid=by_ctid,
            limits=SweepLimits(
                batch_size=10, pause=NO_PAUSE, statement_timeout=timedelta(seconds=2)
            ),
        )
        result = sweep(dsn, sweeper)
        assert time.monotonic() - started < 2
        assert result.deleted == 29
    assert remaining(dsn) == 1


def test_per_scope_retention(dsn: str, by_ctid: bool) -> None:
    add_keys(dsn, 4, age=40 * DAY, scope="audit")
    add_keys(dsn, 4, age=40 * DAY, scope="api")
    add_keys(dsn, 2, age=10 * DAY, scope="chatty")
    add_keys(dsn, 3, age=5 * DAY, scope="chatty", prefix="recent-")
    policy = RetentionPolicy(
        scopes={
            "audit": Retention(keep=90 * DAY),
            "chatty": Retention(keep=7 * DAY, retry_horizon=DAY),
        }
    )
    assert sweep(dsn, Sweeper([policy], ctid=by_ctid, limits=limits(100))).deleted == 6
    assert remaining(dsn, "scope = 'audit'") == 4
    assert remaining(dsn, "scope = 'api'") == 0
    assert remaining(dsn, "scope = 'chatty'") == 3


def test_the_statement_timeout_applies_to_each_batch_and_ends_with_it(dsn: str) -> None:
    add_keys(dsn, 5, age=40 * DAY)
    sweeper = Sweeper(
        limits=SweepLimits(
            batch_size=10, pause=NO_PAUSE, statement_timeout=timedelta(milliseconds=200)
        )
    )
    with psycopg.connect(dsn) as blocker, psycopg.connect(dsn, autocommit=True) as conn:
        # A table lock makes the batch wait; only its statement timeout can end that wait.
        blocker.execute("LOCK TABLE pgonce.keys IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        with pytest.raises(DatabaseError, match="statement timeout"):
            sweeper.sweep(conn, now=NOW)
        assert time.monotonic() - started < 5
        blocker.rollback()
        # SET LOCAL: the connection keeps its own setting once the batch is over.
        assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
        assert sweeper.sweep(conn, now=NOW).deleted == 5


def test_a_connection_inside_a_transaction_is_refused(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(UsageError, match="not inside a transaction"):
            Sweeper().sweep(conn, now=NOW)


def test_a_retention_shorter_than_the_horizon_refuses_to_build_a_sweeper() -> None:
    with pytest.raises(ConfigError, match=r"scope 'stripe' is 1d, shorter than .* 3d"):
        Sweeper([RetentionPolicy(scopes={"stripe": Retention(keep=DAY, retry_horizon=3 * DAY)})])


async def test_concurrent_sweepers_on_separate_connections_never_double_count(
    dsn: str, by_ctid: bool
) -> None:
    add_keys(dsn, 3000, age=40 * DAY)
    add_keys(dsn, 50, age=40 * DAY, completed=False, prefix="in-flight-")
    sweeper = AsyncSweeper(ctid=by_ctid, limits=SweepLimits(batch_size=25, pause=NO_PAUSE))

    async def one() -> int:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            return (await sweeper.sweep(conn, now=NOW)).deleted

    counts = await asyncio.gather(*(one() for _ in range(6)))
    # A sweeper may stop early at a batch made short by rows its peers hold; a last run drains.
    counts.append(sweep(dsn, Sweeper(ctid=by_ctid, limits=limits(25))).deleted)
    assert sum(counts) == 3000
    assert remaining(dsn) == 50
    assert remaining(dsn, "key LIKE 'in-flight-%'") == 50


PGONCE = [sys.executable, "-m", "pgonce"]


def sweep_args(dsn: str, *options: str) -> list[str]:
    """The arguments of ``pgonce sweep`` on ``dsn`` at NOW."""
    return ["sweep", "--dsn", dsn, "--target", "keys", "--now", NOW.isoformat(), *options]


def test_concurrent_sweep_processes_never_double_count(dsn: str) -> None:
    add_keys(dsn, 4000, age=40 * DAY)
    add_keys(dsn, 20, age=40 * DAY, completed=False, prefix="in-flight-")
    processes = [
        subprocess.Popen(
            [*PGONCE, *sweep_args(dsn, "--batch-size", "20", "--pause", "0s")],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in processes]
    assert all(p.returncode == 0 for p in processes)
    counts = [int(re.search(r"swept ([\d,]+) rows", o)[1].replace(",", "")) for o in outputs]  # type: ignore[index]
    counts.append(sweep(dsn, Sweeper(limits=limits(20))).deleted)
    assert sum(counts) == 4000
    assert remaining(dsn) == 20


def test_cli_prints_one_final_line_when_not_on_a_terminal(dsn: str) -> None:
    add_keys(dsn, 12, age=40 * DAY)
    done = pgonce(*sweep_args(dsn, "--batch-size", "5"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()]
    assert done.stdout.startswith("swept 12 rows (keys 12) in 3 batches")
    assert done.stderr == ""
    add_keys(dsn, 3, age=40 * DAY, prefix="more-")
    quiet = pgonce(*sweep_args(dsn, "--quiet"))
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    assert remaining(dsn) == 0


def test_cli_refuses_a_retention_shorter_than_the_horizon(dsn: str) -> None:
    add_keys(dsn, 3, age=40 * DAY)
    done = pgonce("sweep", "--dsn", dsn, "--scope-retention", "stripe=1d/3d")
    assert done.returncode == 1
    assert "scope 'stripe' is 1d, shorter than its retry horizon of 3d" in done.stderr
    assert "Traceback" not in done.stderr
    assert remaining(dsn) == 3


async def test_the_timer_loop_sweeps_until_stopped(dsn: str) -> None:
    add_keys(dsn, 40, age=400 * DAY)
    stop = asyncio.Event()
    runs: list[SweepResult] = []

    def on_run(result: SweepResult) -> None:
        runs.append(result)
        if len(runs) == 2:
            stop.set()

    sweeper = AsyncSweeper(limits=SweepLimits(batch_size=10, pause=NO_PAUSE))
    async with AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as pool:
        await asyncio.wait_for(
            sweep_every(pool, sweeper, stop, every=timedelta(milliseconds=20), on_run=on_run),
            timeout=30,
        )
    assert [r.deleted for r in runs] == [40, 0]
    assert remaining(dsn) == 0


def test_a_stop_request_ends_a_run_between_batches(dsn: str) -> None:
    add_keys(dsn, 100, age=40 * DAY)
    stop = threading.Event()

    def on_batch(_target: str, _deleted: int) -> None:
        stop.set()

    with psycopg.connect(dsn, autocommit=True) as conn:
        result = Sweeper(limits=limits(10)).sweep(conn, now=NOW, stop=stop, on_batch=on_batch)
    (keys,) = result.targets
    assert (keys.deleted, keys.batches, keys.ending) == (10, 1, "stopped")
    assert "stopped on request" in result.summary()


def test_cli_shows_progress_and_the_count_on_a_terminal(dsn: str) -> None:
    add_keys(dsn, 12, age=40 * DAY)
    controller, terminal = pty.openpty()
    try:
        done = subprocess.run(
            [*PGONCE, *sweep_args(dsn, "--batch-size", "5")],
            stdout=subprocess.PIPE,
            stderr=terminal,
            text=True,
            check=False,
            timeout=120,
        )
        os.close(terminal)
        shown = b""
        while chunk := _read_pty(controller):
            shown += chunk
    finally:
        os.close(controller)
    assert done.returncode == 0
    assert b"pgonce sweep: keys 10 rows, 2 batches" in shown
    assert b"\rpgonce sweep: keys 12 rows, 3 batches" in shown
    assert done.stdout.startswith("swept 12 rows (keys 12) in 3 batches")


def _read_pty(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: the terminal's other end is closed and everything was read
        return b""


def test_the_sync_timer_loop_survives_a_failed_run(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pgonce.sweeper")
    add_keys(dsn, 15, age=400 * DAY)
    stop = threading.Event()
    runs: list[SweepResult] = []

    def on_run(result: SweepResult) -> None:
        runs.append(result)
        stop.set()

    sweeper = Sweeper(
        limits=SweepLimits(
            batch_size=10, pause=NO_PAUSE, statement_timeout=timedelta(milliseconds=100)
        )
    )
    with psycopg.connect(dsn) as blocker, ConnectionPool(dsn, min_size=1, max_size=1) as pool:
        # The first run times out on the table lock; the loop must log it and try again.
        blocker.execute("LOCK TABLE pgonce.keys IN ACCESS EXCLUSIVE MODE")
        loop = threading.Thread(
            target=sync_sweep_every,
            args=(pool, sweeper, stop),
            kwargs={"every": timedelta(milliseconds=50), "on_run": on_run},
        )
        loop.start()
        _wait_for_warning(caplog, "sweep failed")
        blocker.rollback()
        loop.join(timeout=30)
    assert not loop.is_alive()
    assert [r.deleted for r in runs] == [15]
    assert remaining(dsn) == 0


def _wait_for_warning(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 10.0) -> None:
    """Return once a log record containing ``text`` was emitted (from any thread)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in record.getMessage() for record in caplog.records):
            return
        time.sleep(0.01)
    raise AssertionError(f"no log record said {text!r}")


def test_each_ctid_twin_is_its_portable_statement_but_for_the_join() -> None:
    # The twin must not drift: the rows it chooses are exactly the portable statement's.
    statements = parse_named(
        resources.files("pgonce.sql").joinpath("queries", "sweep.sql").read_text()
    )
    for name, target in TARGETS.items():
        if not target.has_ctid_twin:
            continue
        portable = statements[f"delete_{name}"].splitlines()
        twin = statements[f"delete_{name}_by_ctid"].splitlines()
        body = [line for line in portable if not line.startswith("--")]
        twin_body = [line for line in twin if not line.startswith("--")]
        assert twin_body[:-1] == body[:-1]
        assert "ctid" in twin_body[-1]
        assert "ctid" not in body[-1]


def test_plain_postgresql_is_swept_by_ctid_unless_told_otherwise(dsn: str) -> None:
    add_keys(dsn, 3, age=40 * DAY)
    (auto,) = sweep(dsn, Sweeper(limits=limits(10))).targets
    assert (auto.deleted, auto.by_ctid) == (3, True)
    add_keys(dsn, 3, age=40 * DAY, prefix="again-")
    (portable,) = sweep(dsn, Sweeper(ctid=False, limits=limits(10))).targets
    assert (portable.deleted, portable.by_ctid) == (3, False)


def test_each_batch_commits_on_a_connection_without_autocommit(dsn: str) -> None:
    add_keys(dsn, 30, age=40 * DAY)
    seen: list[int] = []

    def on_batch(_target: str, _deleted: int) -> None:
        # Another connection sees every batch once it returns: each was its own transaction.
        seen.append(remaining(dsn))

    with psycopg.connect(dsn) as conn:
        Sweeper(limits=limits(10)).sweep(conn, now=NOW, on_batch=on_batch)
        assert conn.info.transaction_status == TransactionStatus.IDLE
    assert seen == [20, 10, 0, 0]


def test_a_naive_now_is_refused_and_nothing_is_deleted(dsn: str) -> None:
    # A naive clock is read in the session's time zone: west of UTC, utcnow() is hours ahead,
    # and keys whose senders may still retry them would go.
    add_keys(dsn, 5, age=40 * DAY)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(UsageError, match="timezone-aware"):
            Sweeper().sweep(conn, now=NOW.replace(tzinfo=None))
        with pytest.raises(UsageError, match="datetime or None"):
            Sweeper().sweep(conn, now="2026-06-01")  # type: ignore[arg-type]
    assert remaining(dsn) == 5


async def test_the_timer_loop_survives_an_unreachable_server_logs_once_and_counts(
    unused_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    # The pool's own errors (PoolTimeout: no server answers) are psycopg errors, not pgonce's:
    # they must not end the loop, and a run of them is one warning, every one counted.
    caplog.set_level(logging.DEBUG, logger="pgonce.sweeper")
    stop = asyncio.Event()
    failures: list[Exception] = []

    def on_failure(error: Exception) -> None:
        failures.append(error)
        if len(failures) == 3:
            stop.set()

    dead = f"postgresql://postgres@127.0.0.1:{unused_port}/test?connect_timeout=1"
    pool = AsyncConnectionPool(dead, min_size=0, max_size=1, timeout=0.2, open=False)
    await pool.open()
    try:
        await asyncio.wait_for(
            sweep_every(
                pool,
                AsyncSweeper(),
                stop,
                every=timedelta(milliseconds=20),
                on_failure=on_failure,
            ),
            timeout=30,
        )
    finally:
        await pool.close()
    assert len(failures) == 3
    warnings = [
        r for r in caplog.records if r.name == "pgonce.sweeper" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1
    assert "tries again every" in warnings[0].getMessage()
    # pgonce serve counts each one by its class (service.runner passes this as on_failure).
    metrics = ServiceMetrics()
    for failure in failures:
        metrics.record_sweep_failure(failure)
    reason = type(failures[0]).__name__
    assert f'pgonce_sweeper_failures_total{{reason="{reason}"}} 3.0' in metrics.render().decode()


@pytest.fixture
def unused_port() -> int:
    """A TCP port on which nothing listens (bound, then closed)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_a_stalled_network_ends_the_sweep_with_a_typed_error(direct_dsn: str) -> None:
    # The batch's statement timeout is the server's: with answers held back it never reaches
    # the sweeper, which must not wait forever (the loop would hold its connection for good).
    from tests.stalling import proxy_to, through

    add_keys(direct_dsn, 5, age=40 * DAY)
    short = SweepLimits(statement_timeout=timedelta(milliseconds=500), pause=NO_PAUSE)
    with proxy_to(direct_dsn) as proxy:
        for ctid in (None, False):  # the Citus probe first, then a batch
            with psycopg.connect(through(proxy, direct_dsn), autocommit=True) as conn:
                proxy.hold(True)
                started = time.monotonic()
                with pytest.raises(DatabaseError):
                    Sweeper(limits=short, ctid=ctid).sweep(conn, now=NOW)
                assert time.monotonic() - started < 10
                assert conn.broken
                proxy.hold(False)
    assert remaining(direct_dsn) == 5


def test_a_stop_request_ends_the_whole_run_not_only_the_current_target(dsn: str) -> None:
    # A stop during the first target's run used to let every later target run one batch.
    add_keys(dsn, 30, age=40 * DAY)
    stop = threading.Event()
    batches: list[str] = []

    def on_batch(target: str, _deleted: int) -> None:
        batches.append(target)
        stop.set()

    with psycopg.connect(dsn, autocommit=True) as conn:
        result = AnySweeper(limits=limits(10)).sweep(conn, now=NOW, stop=stop, on_batch=on_batch)
    assert batches == ["keys"]
    assert [(t.target, t.batches, t.ending) for t in result.targets] == [
        ("keys", 1, "stopped"),
        ("inbox", 0, "stopped"),
        ("outbox", 0, "stopped"),
        ("outbox_aggregates", 0, "stopped"),
    ]
    assert remaining(dsn) == 20


def test_a_failing_target_does_not_starve_the_targets_after_it(dsn: str) -> None:
    # Keys are swept first: with the key table locked run after run, the inbox and the outbox
    # were never swept at all.
    from tests.test_sweep_targets import add_event

    add_keys(dsn, 5, age=40 * DAY)
    with psycopg.connect(dsn, autocommit=True) as conn:
        add_event(conn, "stripe", "old", "done", 40 * DAY)
    short = SweepLimits(pause=NO_PAUSE, statement_timeout=timedelta(milliseconds=200))
    with psycopg.connect(dsn) as blocker, psycopg.connect(dsn, autocommit=True) as conn:
        blocker.execute("LOCK TABLE pgonce.keys IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(DatabaseError, match="sweeping keys"):
            AnySweeper(limits=short, targets=["keys", "inbox"]).sweep(conn, now=NOW)
        assert conn.info.transaction_status == TransactionStatus.IDLE
        blocker.rollback()
        inbox = conn.execute("SELECT count(*) FROM pgonce.inbox").fetchone()
    assert inbox == (0,)
    assert remaining(dsn) == 5


def test_limits_and_ctid_of_the_wrong_kind_are_refused_when_made() -> None:
    # limits=5 failed only at the first sweep, with an AttributeError.
    wrongs: list[dict[str, Any]] = [{"limits": 5}, {"ctid": "yes"}]
    for wrong in wrongs:
        with pytest.raises(UsageError, match=next(iter(wrong))):
            AnySweeper(**wrong)


async def test_an_interval_that_is_no_timedelta_is_refused(dsn: str) -> None:
    async with AsyncConnectionPool(dsn, min_size=0, max_size=1, open=False) as pool:
        with pytest.raises(UsageError, match="sweep interval"):
            await sweep_every(pool, AsyncSweeper(), asyncio.Event(), every=300)  # type: ignore[arg-type]


def _terminate_after(killer: psycopg.Connection[Any], pid: int, batches: int) -> Any:
    """An on_batch that ends the sweeper's server session once ``batches`` batches committed."""
    seen: list[int] = []

    def on_batch(_target: str, deleted: int) -> None:
        seen.append(deleted)
        if len(seen) == batches:
            # Waits (up to 10 s) until the backend has gone: the next batch meets a dead session.
            killer.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))

    return on_batch


def test_a_run_that_fails_midway_reports_what_its_committed_batches_deleted(
    direct_dsn: str,
) -> None:
    # The failure alone read as if the run had deleted nothing, and the service's counter of
    # rows deleted missed every batch of a run that failed later.
    from pgonce import swept_before
    from pgonce.store._sync.sweeper import failure_summary

    add_keys(direct_dsn, 100, age=40 * DAY)
    with (
        psycopg.connect(direct_dsn, autocommit=True) as killer,
        psycopg.connect(direct_dsn, autocommit=True) as conn,
    ):
        on_batch = _terminate_after(killer, conn.info.backend_pid, 3)
        with pytest.raises(DatabaseError) as failed:
            Sweeper(limits=limits(10)).sweep(conn, now=NOW, on_batch=on_batch)
    assert remaining(direct_dsn) == 70
    assert swept_before(failed.value) == {"keys": 30}
    assert failure_summary(failed.value).startswith(
        "sweep failed after deleting 30 rows (keys 30) in batches committed before the failure: "
    )
    metrics = ServiceMetrics()
    metrics.record_sweep_failure(failed.value)
    page = metrics.render().decode()
    assert 'pgonce_sweeper_rows_deleted_total{target="keys"} 30.0' in page
    assert 'pgonce_sweeper_failures_total{reason="DatabaseUnavailable"} 1.0' in page


def test_cli_says_what_a_failed_run_had_deleted_and_exits_1(direct_dsn: str) -> None:
    add_keys(direct_dsn, 100, age=40 * DAY)
    process = subprocess.Popen(
        [*PGONCE, *sweep_args(direct_dsn, "--batch-size", "10", "--pause", "100ms")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with psycopg.connect(direct_dsn, autocommit=True) as watcher:
            # Mid-run: once two batches have committed, end every other session of the database.
            deadline = time.monotonic() + 60
            while _count(watcher) > 80:
                assert process.poll() is None, process.communicate()
                assert time.monotonic() < deadline, "the sweep never got going"
            killed = watcher.execute(
                """SELECT count(pg_terminate_backend(pid, 10000)) FROM pg_stat_activity
                    WHERE datname = current_database() AND pid <> pg_backend_pid()
                      AND backend_type = 'client backend'"""
            ).fetchone()
            assert killed is not None
            assert killed[0] >= 1
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    deleted = 100 - remaining(direct_dsn)
    assert 20 <= deleted < 100
    assert process.returncode == 1
    assert out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(
        f"pgonce: error: sweep failed after deleting {deleted} rows (keys {deleted}) in batches "
        "committed before the failure: "
    ), line


def _count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    assert row is not None
    return int(row[0])
