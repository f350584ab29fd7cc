"""once() in psycopg's pipeline, and the sweeper, behind PgBouncer in transaction mode with
psycopg's default ``prepare_threshold``.

There the key store's statements go through psycopg, which prepares them after five runs under
names of its own (``_pg3_0``...): through a transaction-mode pooler before 1.21 several clients
sharing one server session meet each other's names (42P05, 26000). pgonce's own batches refuse
such a connection with a UsageError naming ``prepare_threshold=None``; the pipelined claim used to
let psycopg's bare DatabaseError through instead, and the refusal never started.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from pgonce import KeyStore, Response, fingerprint
from pgonce.errors import UsageError
from tests.pgbouncer import started_pgbouncer, through

FP = fingerprint("pooled pipeline")
CLIENTS = 6
CALLS = 60


def _clients(dsn: str, store: KeyStore) -> tuple[int, list[BaseException]]:
    """CLIENTS connections (psycopg's defaults) each running CALLS pipelined once(): how many
    stored their response, and every error that reached the caller."""
    stored = 0
    failures: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def client(n: int) -> None:
        nonlocal stored
        with psycopg.connect(dsn) as conn:
            start.wait(timeout=30)
            for i in range(CALLS):
                try:
                    with conn.pipeline():
                        with store.once(conn, "s", f"{n}-{i}", FP) as op:
                            op.respond(Response(201, (), b"ok"))
                        conn.commit()
                    with lock:
                        stored += op.stored
                except Exception as error:
                    with lock:
                        failures.append(error)
                    if not conn.closed:
                        conn.rollback()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return stored, failures


def test_pipelined_once_on_a_shared_server_session_is_refused_not_crossed(
    direct_dsn: str, server_dsn: str
) -> None:
    store = KeyStore()
    with started_pgbouncer(server_dsn, pool_size=1) as bouncer:
        stored, failures = _clients(through(bouncer, direct_dsn), store)
    bare = [e for e in failures if not isinstance(e, UsageError)]
    assert not bare, f"{len(bare)} of {len(failures)} not refused, e.g. {bare[0]!r}"
    assert failures, "the clients met no shared statement name: nothing was tested"
    for error in failures:
        assert "prepare_threshold=None" in str(error), error
    assert stored + len(failures) == CLIENTS * CALLS


def test_pipelined_once_without_prepared_statements_all_win(
    direct_dsn: str, server_dsn: str
) -> None:
    store = KeyStore()
    with started_pgbouncer(server_dsn, pool_size=1) as bouncer:
        kwargs: dict[str, Any] = {"prepare_threshold": None}
        stored = 0
        with psycopg.connect(through(bouncer, direct_dsn), **kwargs) as conn:
            for i in range(20):
                with conn.pipeline():
                    with store.once(conn, "s", f"k{i}", FP) as op:
                        op.respond(Response(201, (), b"ok"))
                    conn.commit()
                stored += op.stored
    assert stored == 20
