"""A two-phase payment request in a process of its own, for the crash and zombie tests
and the fault suite's two-phase scenario.

``python -m faults.payer DSN KEY PROVIDER_URL [--crash POINT] [--pause POINT]
[--ahead SECONDS]`` runs POST /payments for KEY: a phase_payments row (phase "create"), a
charge at the fake provider (call "charge"), the answer with the charge id (finish). At
``--crash POINT`` the process kills itself with SIGKILL; at ``--pause POINT`` it prints
"paused" and stops itself with SIGSTOP (the test resumes it with SIGCONT). ``--ahead`` moves
its clock on, so that it may take over a lease that a crashed holder left. It prints one JSON
line: its outcome and the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pgonce import LeaseLost, Response, fingerprint
from pgonce.phases import PhasedOperation, PhaseStore
from pgonce.testing import charge

#: Every boundary of the request, in order.
POINTS = (
    "after-claim",
    "before-create-commit",
    "after-create-commit",
    "before-charge",
    "after-charge",
    "after-charge-commit",
    "before-finish-commit",
    "after-finish-commit",
)
AMOUNT = 4200


def request_of(key: str) -> bytes:
    """The fingerprint of the payment request with ``key``: every client of a payment sends it."""
    return fingerprint("POST", "/payments", key)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dsn")
    parser.add_argument("key")
    parser.add_argument("provider")
    parser.add_argument("--crash")
    parser.add_argument("--pause")
    parser.add_argument("--ahead", type=float, default=0)
    args = parser.parse_args()
    now = datetime.now(UTC) + timedelta(seconds=args.ahead)

    def point(name: str) -> None:
        if name == args.crash:
            os.kill(os.getpid(), signal.SIGKILL)
        if name == args.pause:
            print("paused", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def pay(op: PhasedOperation[Any]) -> Response:
        def create(conn: psycopg.Connection[Any]) -> dict[str, Any]:
            conn.execute(
                "INSERT INTO phase_payments (key, amount) VALUES (%s, %s)", (op.key, AMOUNT)
            )
            point("before-create-commit")
            return {"payment": op.key}

        op.phase("create", create, now=now)
        point("after-create-commit")

        def call_provider(idempotency_key: str) -> dict[str, Any]:
            point("before-charge")
            made = charge(args.provider, idempotency_key, payment=op.key, amount=AMOUNT)
            point("after-charge")
            return made

        made = op.call("charge", call_provider, now=now)
        point("after-charge-commit")
        body = json.dumps({"payment": op.key, "charge": made["id"], "holder": os.getpid()})
        return Response(201, (("content-type", "application/json"),), body.encode())

    def record(conn: psycopg.Connection[Any], op: PhasedOperation[Any]) -> None:
        conn.execute(
            "UPDATE phase_payments SET charge = %s WHERE key = %s",
            (op.state["charge"]["id"], op.key),
        )
        point("before-finish-commit")

    store = PhaseStore()
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        op = store.start(conn, "payments", args.key, request_of(args.key), now=now)
        if not op.won:
            answer = op.response.body.decode() if op.response else None
            print(json.dumps({"outcome": op.claim.kind, "answer": answer}), flush=True)
            return
        point("after-claim")
        try:
            response = pay(op)
            op.finish(response, writes=lambda c: record(c, op), now=now)
        except LeaseLost:
            print(json.dumps({"outcome": "lease_lost", "answer": None}), flush=True)
            return
        point("after-finish-commit")
        print(json.dumps({"outcome": "stored", "answer": response.body.decode()}), flush=True)


if __name__ == "__main__":
    main()
