"""What an operation costs PostgreSQL: CPU µs and WAL bytes per operation, beside a bare reference.

At scale the database is the part a deployment cannot simply multiply, so its cost per request is
measured on the server's side: the CPU time of every PostgreSQL process (the backends, including
those that exited during the run, whose time the postmaster collects, and the background writers)
and the WAL written (the server's WAL position before and after), split by ``pg_waldump --stats``
into the records and the full-page images: a page's first change after a checkpoint writes the
whole page, so the images follow when the checkpoints fell, not the statements (one run's fresh
key read 727 bytes, the next one's 1,393 with a checkpoint inside it). Both count the whole
server: on a shared server another client's work lands in them, which is why each figure stands
beside its reference, measured in the same run by the same means. The load is pgbench's, whose own
CPU is not the server's.

The middleware workload, which runs before the key store's, leaves its figures in
:data:`MIDDLEWARE`; the key store's workload then reports the issue's targets in one table.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench.clients import pgbench_command
from bench.servers import backend_cpu


@dataclass(frozen=True)
class Cost:
    """One pgbench run's server-side cost."""

    tx: int
    cpu_seconds: float
    #: WAL records' bytes, full-page images left out.
    wal_bytes: int
    #: Bytes of full-page images over the run.
    image_bytes: int = 0

    @property
    def cpu_us(self) -> float:
        """PostgreSQL CPU µs per transaction."""
        return self.cpu_seconds / self.tx * 1e6

    @property
    def wal(self) -> float:
        """WAL bytes per transaction, without full-page images."""
        return self.wal_bytes / self.tx

    @property
    def images(self) -> float:
        """Bytes of full-page images per transaction."""
        return self.image_bytes / self.tx


#: Figures of the middleware workload of this run: "cpu", "cpu_bare" (µs/req), "wal",
#: "wal_bare" (bytes/req), "best", "median" (throughput over no middleware).
MIDDLEWARE: dict[str, float] = {}


def postmaster(dsn: str) -> int | None:
    """The server's postmaster pid, when the server runs on this machine (else None).

    The parent of this connection's backend, read while the connection is open: a backend
    exits as its client disconnects, and a reading after that would find no process.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        try:
            with open(f"/proc/{row[0]}/stat") as stat:
                return int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return None


def _exited_children(pm: int) -> float:
    """CPU seconds of the postmaster's children that exited and were waited for (cutime,
    cstime: clock ticks, one tick of error per exited backend at most)."""
    try:
        with open(f"/proc/{pm}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def server_cpu(pm: int) -> float:
    """CPU seconds the whole server has spent: the postmaster with its exited children, and
    its live children (backends, WAL writer, checkpointer...)."""
    try:
        with open(f"/proc/{pm}/task/{pm}/children") as listing:
            children = [int(pid) for pid in listing.read().split()]
    except OSError:
        children = []
    return _exited_children(pm) + sum(backend_cpu(pid) for pid in (pm, *children))


def run(dsn: str, script: str, clients: int, seconds: float) -> Cost:
    """pgbench ``script`` for ``seconds``; the server's CPU and WAL over its transactions.

    Every figure is read, never assumed: a server whose processes cannot be read from here, a
    run without transactions or without CPU time is an error, not a figure of zero.
    """
    pm = postmaster(dsn)
    if pm is None:
        raise RuntimeError(
            "the server's CPU time cannot be read: its processes are not visible from here "
            "(run the benchmark on the machine that runs PostgreSQL)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        script_file = Path(tmp) / "script.sql"
        script_file.write_text(script)
        wal_before = _insert_lsn(dsn)
        cpu_before = server_cpu(pm)
        result = subprocess.run(
            pgbench_command(script_file, dsn, clients, seconds),
            capture_output=True,
            text=True,
            check=False,
        )
        # pgbench has disconnected: its backends have exited, their time is the postmaster's.
        cpu = server_cpu(pm) - cpu_before
        if result.returncode != 0:
            raise RuntimeError(f"pgbench failed: {result.stderr.strip()[-500:]}")
        wal, images = wal_split(dsn, wal_before, _insert_lsn(dsn))
    for line in result.stdout.splitlines():
        if line.startswith("number of transactions actually processed:"):
            tx = int(line.split(":")[1].split()[0].split("/")[0])
            if tx <= 0 or cpu <= 0:
                raise RuntimeError(
                    f"a pgbench run read {tx} transactions and {cpu:.3f} s of server CPU: "
                    "nothing was measured"
                )
            return Cost(tx, cpu, wal, images)
    raise RuntimeError(f"pgbench said no transaction count: {result.stdout[-300:]}")


_TOTAL = re.compile(r"^Total\s+\d+\s+(\d+) \[[^]]*\]\s+(\d+) \[", re.MULTILINE)


def _insert_lsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def wal_split(dsn: str, start: str, end: str) -> tuple[int, int]:
    """The bytes of WAL records and of full-page images between two WAL positions, as the
    server's own ``pg_waldump --stats`` counts them (read at once: a later checkpoint may
    recycle the segments)."""
    if start == end:  # nothing written (a replay): pg_waldump would find no record to read
        return 0, 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('data_directory'),"
            " (SELECT setting FROM pg_config WHERE name = 'BINDIR')"
        ).fetchone()
        assert row is not None
        data, bindir = row
        _await_flush(conn, end)
    result = subprocess.run(
        [
            str(Path(bindir) / "pg_waldump"),
            "--stats",
            "-p",
            str(Path(data) / "pg_wal"),
            "-s",
            start,
            "-e",
            end,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    found = _TOTAL.search(result.stdout)
    if found is None:
        raise RuntimeError(
            f"pg_waldump read no WAL between {start} and {end}: {result.stderr.strip()[-300:]}"
        )
    return int(found[1]), int(found[2])


def _await_flush(conn: psycopg.Connection[Any], end: str, timeout: float = 10.0) -> None:
    """Wait until the WAL up to ``end`` is on disk, where pg_waldump reads it.

    A run that commits nothing (a replay) may still see a record another process wrote (the
    background writer's snapshot of running transactions, every 15 s of activity), and such a
    record waits in the WAL buffers for the WAL writer: read at once, pg_waldump finds no valid
    record where it starts. A transaction that takes an id and commits flushes everything
    before its commit record (which lands after ``end``, outside the range read).
    """
    with conn.transaction():
        conn.execute("SELECT pg_current_xact_id()")
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (end,)).fetchone()
        if row is not None and row[0]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the WAL up to {end} was not flushed within {timeout:.0f} s")
        # With synchronous_commit off the commit above does not wait for the flush; the WAL
        # writer does it within wal_writer_delay.
        time.sleep(0.01)


def alternated(
    dsn: str, scripts: list[str], clients: int, seconds: float, rounds: int
) -> list[Cost]:
    """Each script ``rounds`` times, taking turns (every other round in reverse order), summed:
    a drift of the machine during the run falls on every script alike."""
    totals = [Cost(0, 0.0, 0) for _ in scripts]
    for number in range(rounds):
        order = range(len(scripts)) if number % 2 == 0 else reversed(range(len(scripts)))
        for i in order:
            cost = run(dsn, scripts[i], clients, seconds)
            old = totals[i]
            totals[i] = Cost(
                old.tx + cost.tx,
                old.cpu_seconds + cost.cpu_seconds,
                old.wal_bytes + cost.wal_bytes,
                old.image_bytes + cost.image_bytes,
            )
    return totals
