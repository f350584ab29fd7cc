"""A producer of one aggregate's events in a process of its own, for the ordering tests.

``python -m tests.outbox.producer_process DSN AGGREGATE PRODUCER TRANSACTIONS [--unordered]``
waits for a "go" line on stdin, then runs TRANSACTIONS transactions, each enqueueing one event or,
every third one, a batch of three (enqueue_many) for AGGREGATE, pausing up to 2 ms before its
COMMIT so that transactions of the processes overlap. For each transaction it prints a JSON line:
the ids it got and the monotonic clock (shared by every process of the machine) just before COMMIT
was sent and just after it returned.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import psycopg

from pgonce.core.outbox import OutboxEvent
from pgonce.store._sync.outbox import enqueue, enqueue_many


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dsn")
    parser.add_argument("aggregate")
    parser.add_argument("producer", type=int)
    parser.add_argument("transactions", type=int)
    parser.add_argument("--unordered", action="store_true")
    args = parser.parse_args()
    ordered = not args.unordered
    rng = random.Random(args.producer)
    with psycopg.connect(args.dsn) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        for n in range(args.transactions):
            payload = {"producer": args.producer, "n": n}
            if n % 3 == 2:
                events = [OutboxEvent("order", args.aggregate, f"e{k}", payload) for k in range(3)]
                ids = enqueue_many(conn, events, ordered=ordered)
            else:
                ids = [enqueue(conn, "order", args.aggregate, "e", payload, ordered=ordered)]
            time.sleep(rng.random() * 0.002)
            started = time.monotonic_ns()
            conn.commit()
            ended = time.monotonic_ns()
            print(json.dumps({"ids": ids, "started": started, "ended": ended}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
