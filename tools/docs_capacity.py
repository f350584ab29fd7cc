"""How far one primary goes: the capacity figures of "Beyond one primary", from the latest report.

``<!-- pgonce:capacity -->`` becomes the measured figures (read from ``bench/results/latest.md``
at build time) and what follows from them per claimed request and at 100,000 claims a second.
Written by hand, such figures went stale with every benchmark run; read from the report, the page
and the report cannot disagree. A row this needs that the report lacks fails the build, naming
it, rather than publishing an empty figure.
"""

from __future__ import annotations

import re
from pathlib import Path

from tools.docs_plots import Table, tables

REPORT = Path(__file__).resolve().parent.parent / "bench" / "results" / "latest.md"

#: The rate the last table extrapolates to, claims a second.
TARGET_RATE = 100_000
#: The utilisation a team plans its CPU for: a server busy beyond it queues.
PLANNED_UTILISATION = 0.6
#: Server connections a pool keeps per busy one (room for bursts and slow transactions).
POOL_PER_BUSY = 2

_OVERHEAD = "Key store: database-level overhead (pgbench only)"
_COST = "Database cost per request"


def _table(found: dict[str, Table], title: str) -> Table:
    if title not in found:
        raise ValueError(f"{REPORT.name}: no section {title!r} (the capacity figures read it)")
    return found[title]


def _row(table: Table, column: str, starts: str) -> dict[str, str]:
    for row in table.rows:
        if row.get(column, "").startswith(starts):
            return row
    raise ValueError(f"{REPORT.name}: section {table.title!r} has no row {starts!r}")


def _number(cell: str) -> float:
    digits = re.sub(r"[^0-9.]", "", cell)
    if not digits:
        raise ValueError(f"{REPORT.name}: {cell!r} is not a figure")
    return float(digits)


def _header(markdown: str, pattern: str) -> str:
    match = re.search(pattern, markdown, re.MULTILINE)
    if match is None:
        raise ValueError(f"{REPORT.name}: no line matching {pattern!r}")
    return match.group(1)


def capacity(markdown: str | None = None) -> str:
    """The section's Markdown, from the report's text (``latest.md``'s when not given)."""
    text = REPORT.read_text() if markdown is None else markdown
    found = {table.title: table for table in tables(text)}
    overhead, cost = _table(found, _OVERHEAD), _table(found, _COST)

    commit = _header(text, r"^Commit: `([0-9a-f]{7})")
    server = _header(text, r"^- \*\*PostgreSQL\*\*: (PostgreSQL [0-9.]+)")
    trips = _row(overhead, "shape", "pgonce's own shape (2 trips)")
    business = _row(overhead, "shape", "business transaction")
    connections = int(_number(trips["conns"]))
    rate, bare_rate = _number(trips["tx/s"]), _number(business["tx/s"])

    operation, cpu, wal = "operation", "PostgreSQL CPU µs/op", "WAL bytes/op"
    fresh = _row(cost, operation, "fresh key, begin() + commit()")
    alone = _row(cost, operation, "business transaction alone")
    http = _row(cost, operation, "pgonce, FastAPI dependency")
    http_bare = _row(cost, operation, "no middleware, connection from a FastAPI dependency")
    fresh_cpu, alone_cpu = _number(fresh[cpu]), _number(alone[cpu])
    fresh_wal, alone_wal = _number(fresh[wal]), _number(alone[wal])

    # Little's law: the connections busy at once are the rate times the time each is held.
    held_ms = connections / rate * 1000
    cores = TARGET_RATE * fresh_cpu / 1e6
    wal_mb_s = TARGET_RATE * fresh_wal / 1e6
    busy = TARGET_RATE * held_ms / 1000

    measured = f"`make bench` of {commit}, {server}"
    return "\n".join(
        [
            f"Figures from {measured} (bench/results/latest.md), on one 2-core machine shared by "
            "the client and the server; this page is built from that report, so it shows the "
            "latest run. Rerun the key-store sections with "
            '`make bench BENCH_ARGS="--only keys"`.',
            "",
            "| measured | figure | where |",
            "|---|---|---|",
            f"| a fresh key with its business insert (claim, insert, stored response, COMMIT in "
            f"2 round trips), {connections} connections | {rate:,.0f} transactions/s, "
            f'p99 {trips["p99 ms"]} ms | "{_OVERHEAD}" |',
            f"| the same business transaction without pgonce | {bare_rate:,.0f} transactions/s "
            f"| same table |",
            f"| PostgreSQL CPU per fresh key, with pgonce / the business transaction alone "
            f'| {fresh_cpu:,.0f} / {alone_cpu:,.0f} µs | "{_COST}" |',
            f"| WAL per fresh key (records, page images aside), with pgonce / without "
            f"| {fresh_wal:,.0f} / {alone_wal:,.0f} bytes | same table |",
            f"| PostgreSQL CPU per HTTP request (payment insert, claim, stored response), with "
            f"pgonce / without | {_number(http[cpu]):,.0f} / {_number(http_bare[cpu]):,.0f} µs "
            f"| same table |",
            "",
            "What follows from them, per claimed request (a claim together with the business "
            "write it protects):",
            "",
            f"- **CPU**: about {fresh_cpu:,.0f} µs of PostgreSQL CPU, "
            f"{(fresh_cpu - alone_cpu) / fresh_cpu * 100:.0f} % of it the key store's (claim "
            "and stored response). One core of PostgreSQL carries about "
            f"{1e6 / fresh_cpu:,.0f} claimed requests a second.",
            f"- **WAL**: about {fresh_wal:,.0f} bytes, {fresh_wal - alone_wal:,.0f} of them the "
            "key store's (the claim row, its primary-key entry, the completion as a HOT update), "
            "plus the page images each checkpoint's first changes write.",
            f"- **Connections**: {connections} connections carried {rate:,.0f} transactions a "
            f"second, so each transaction held its connection about {held_ms:.2f} ms (two round "
            "trips plus the commit's flush). By Little's law a rate *R* keeps "
            f"*R* × {held_ms:.2f} ms connections busy.",
            "",
            f"At **{TARGET_RATE:,} claims a second** that is:",
            "",
            f"| resource | for {TARGET_RATE:,} claims/s | note |",
            "|---|---|---|",
            f"| PostgreSQL CPU | {cores:,.0f} cores busy; about "
            f"{cores / PLANNED_UTILISATION:,.0f} at {PLANNED_UTILISATION * 100:.0f} % utilisation "
            "| before any read traffic or vacuum |",
            f"| WAL | {wal_mb_s:,.0f} MB/s, {wal_mb_s * 3600 / 1000:,.0f} GB an hour, page "
            "images aside | shipped to and replayed by every standby |",
            f"| busy connections | {busy:,.0f}; a pool of about {busy * POOL_PER_BUSY:,.0f} "
            "server connections | behind PgBouncer, far fewer client ones |",
        ]
    )
