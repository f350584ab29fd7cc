"""A write of the block that PostgreSQL refuses at the block's end (its flush there) raises what
the same write raises when the caller flushes it inside the block: SQLAlchemy's error over
psycopg's, as the core store raises its caller's writes' own errors.

A lock_timeout (or a deadlock, a serialization failure: OperationalErrors to psycopg) met by the
block's last flush was said as DatabaseUnavailable, the lost server's error, while the same
write flushed a line earlier raised SQLAlchemy's OperationalError. A lost connection is still
DatabaseUnavailable (test_probe_killed_connection.py). Real sessions on a real PostgreSQL.
"""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import once
from pgonce.errors import PgonceError
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order

FP = fingerprint("POST", "/orders", b"{}")


@pytest.mark.parametrize("flushed", ["in the block", "at its end"])
def test_a_lock_timeout_of_the_blocks_write_is_its_own_error(
    dsn: str, engine: Engine, flushed: str
) -> None:
    with Session(engine) as session, session.begin():
        session.add(Order(key="o"))
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT * FROM orders WHERE key = 'o' FOR UPDATE")  # holds the row
        with Session(engine) as session:
            session.execute(text("SET LOCAL lock_timeout = '50ms'"))
            order = session.get(Order, 1)
            assert order is not None
            with (
                pytest.raises(sqlalchemy.exc.OperationalError) as raised,
                once(session, "t", "k", FP) as op,
            ):
                order.amount = 5
                if flushed == "in the block":
                    session.flush()
                op.respond(Response(201))
            assert not isinstance(raised.value, PgonceError)
            assert isinstance(raised.value.orig, psycopg.errors.LockNotAvailable)
            session.rollback()
    assert stored(dsn) == (["o"], [])
