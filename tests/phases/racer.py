"""A retry in a process of its own, for the takeover race: ``python -m tests.phases.racer DSN KEY
SECONDS`` connects, prints "ready", waits for a line on stdin, then starts the two-phase request
KEY with its clock at T0 + SECONDS; when it wins, it records the phase "create" (a row in
race_payments) and stores its answer. It prints one JSON line: its claim and its token.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pgonce import LeaseLost, Response, fingerprint
from pgonce.phases import PhaseStore

T0 = datetime(2031, 1, 1, 12, 0, tzinfo=UTC)
FP = fingerprint("POST", "/payments", b'{"amount": 42}')


def main() -> None:
    dsn, key, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    now = T0 + timedelta(seconds=seconds)
    with psycopg.connect(dsn, autocommit=True) as conn:
        print("ready", flush=True)
        sys.stdin.readline()
        op = PhaseStore(lease=timedelta(seconds=30)).start(conn, "t", key, FP, now=now)
        outcome: dict[str, Any] = {"claim": op.claim.kind, "token": op.token}
        if op.won:

            def create(c: psycopg.Connection[Any]) -> int:
                c.execute(
                    "INSERT INTO race_payments (key, holder) VALUES (%s, %s)", (key, os.getpid())
                )
                return os.getpid()

            try:
                op.phase("create", create, now=now)
                op.finish(Response(201, body=str(os.getpid()).encode()), now=now)
                outcome["stored"] = True
            except LeaseLost:
                outcome["stored"] = False
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
