"""The sweeper behind PgBouncer in transaction mode with psycopg's default ``prepare_threshold``.

Its statements go through psycopg, which prepares them after five runs under names of its own:
two sweepers sharing one server session meet each other's names (42P05, 26000). A run used to
fail with psycopg's bare error, for ever, and nothing said that the connections must not prepare
statements there; now the run is refused with the key store's UsageError naming
``prepare_threshold=None``, and the loop logs it and tries again.
"""

from __future__ import annotations

import psycopg

from pgonce import Sweeper
from pgonce.errors import UsageError
from tests.pgbouncer import started_pgbouncer, through


def test_sweepers_on_a_shared_server_session_are_refused_not_crossed(
    direct_dsn: str, server_dsn: str
) -> None:
    failures: list[BaseException] = []
    with (
        started_pgbouncer(server_dsn, pool_size=1) as bouncer,
        psycopg.connect(through(bouncer, direct_dsn), autocommit=True) as one,
        psycopg.connect(through(bouncer, direct_dsn), autocommit=True) as other,
    ):
        sweeper = Sweeper()
        for _ in range(10):
            for conn in (one, other):
                try:
                    sweeper.sweep(conn)
                except Exception as error:
                    failures.append(error)
    assert failures, "the sweepers met no shared statement name: nothing was tested"
    bare = [e for e in failures if not isinstance(e, UsageError)]
    assert not bare, f"{len(bare)} of {len(failures)} not refused, e.g. {bare[0]!r}"
    assert all("prepare_threshold=None" in str(e) for e in failures)
