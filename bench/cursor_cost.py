"""What pgonce's own cursors cost the client, against a plain ``conn.cursor()``.

``.venv/bin/python -m bench.cursor_cost DSN`` (a migrated database) runs the key store's claim
statement N times through each kind of cursor on one connection, alternated, and prints the
client's CPU time per claim. The store's cursors adapt with a map pgonce builds once
(``pgonce.store.cursors``) instead of the connection's; this shows that choice costs nothing
worth measuring on the claim's path.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from pgonce import KeyStore, fingerprint
from pgonce.store.cursors import cursor

Make = Callable[[psycopg.Connection[Any]], psycopg.Cursor[Any]]


def _plain(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    return conn.cursor(row_factory=tuple_row)


def _per_claim(conn: psycopg.Connection[Any], make: Make, count: int) -> float:
    claim = KeyStore()._sql.claim
    run = uuid.uuid4().hex
    fp = fingerprint("cursor cost")
    started = time.process_time()
    for n in range(count):
        cur = make(conn)
        params = {"scope": "bench-cursor", "key": f"{run}-{n}", "fingerprint": fp}
        cur.execute(claim, {**params, "wait_ms": 1000, "now": None})
        cur.fetchone()
    elapsed = time.process_time() - started
    conn.rollback()
    return elapsed / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dsn")
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    plain: list[float] = []
    pinned: list[float] = []
    with psycopg.connect(args.dsn) as conn:
        _per_claim(conn, cursor, 200)  # warm up: prepared statements, caches
        for _ in range(args.rounds):
            plain.append(_per_claim(conn, _plain, args.count))
            pinned.append(_per_claim(conn, cursor, args.count))
    plain.sort()
    pinned.sort()
    middle = args.rounds // 2
    print(
        f"client CPU per claim, median of {args.rounds} rounds of {args.count}: "
        f"conn.cursor() {plain[middle]:.1f} µs, pgonce's cursor {pinned[middle]:.1f} µs"
    )


if __name__ == "__main__":
    main()
