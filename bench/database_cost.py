"""What an operation costs PostgreSQL: CPU µs and WAL bytes per operation, beside a bare reference.

At scale the database is the part a deployment cannot simply multiply, so its cost per request is
measured on the server's side: the CPU time of every PostgreSQL process (the backends, including
those that exited during the run, whose time the postmaster collects, and the background writers)
and the WAL written (the server's WAL position before and after). Both count the whole server: on
a shared server another client's work lands in them, which is why each figure stands beside its
reference, measured in the same run by the same means. The load is pgbench's, whose own CPU is not
the server's.

The middleware workload, which runs before the key store's, leaves its figures in
:data:`MIDDLEWARE`; the key store's workload then reports the issue's targets in one table.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psycopg

from bench.clients import pgbench_command, wal_position
from bench.servers import backend_cpu


@dataclass(frozen=True)
class Cost:
    """One pgbench run's server-side cost."""

    tx: int
    cpu_seconds: float
    wal_bytes: int

    @property
    def cpu_us(self) -> float:
        """PostgreSQL CPU µs per transaction."""
        return self.cpu_seconds / self.tx * 1e6

    @property
    def wal(self) -> float:
        """WAL bytes per transaction."""
        return self.wal_bytes / self.tx


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
        wal_before = wal_position(dsn)
        cpu_before = server_cpu(pm)
        result = subprocess.run(
            pgbench_command(script_file, dsn, clients, seconds),
            capture_output=True,
            text=True,
            check=False,
        )
        # pgbench has disconnected: its backends have exited, their time is the postmaster's.
        cpu = server_cpu(pm) - cpu_before
        wal = wal_position(dsn) - wal_before
    if result.returncode != 0:
        raise RuntimeError(f"pgbench failed: {result.stderr.strip()[-500:]}")
    for line in result.stdout.splitlines():
        if line.startswith("number of transactions actually processed:"):
            tx = int(line.split(":")[1].split()[0].split("/")[0])
            if tx <= 0 or cpu <= 0:
                raise RuntimeError(
                    f"a pgbench run read {tx} transactions and {cpu:.3f} s of server CPU: "
                    "nothing was measured"
                )
            return Cost(tx, cpu, wal)
    raise RuntimeError(f"pgbench said no transaction count: {result.stdout[-300:]}")


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
                old.tx + cost.tx, old.cpu_seconds + cost.cpu_seconds, old.wal_bytes + cost.wal_bytes
            )
    return totals
