"""A commit of the psycopg connection under a process_batch() handler's session is refused.

The batch's commit()/rollback() through SQLAlchemy's connection were refused, but the psycopg
connection under it was not: a handler's commit there committed every event of the batch as done,
the ones whose handlers had not run yet too (their work never happened), and the batch then
failed with a DatabaseError. Now it is refused as the connection's is: the handler fails, its
failure is recorded, and the other events run and commit. Real PostgreSQL, read from another
connection.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pgonce.contrib.sqlalchemy import TransactionEndRefused, process_batch
from pgonce.core.inbox import InboxEvent
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.test_inbox_sync import POLICY, T0, deliver, inbox


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_a_handlers_commit_of_the_psycopg_connection_is_refused(
    dsn: str, engine: Engine, end: str
) -> None:
    deliver(dsn, "e1", "e2", "e3")
    refused: list[BaseException] = []

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.id))
        session.flush()
        if event.id == "e2":
            driver = session.connection().connection.driver_connection
            try:
                getattr(driver, end)()
            except TransactionEndRefused as error:
                refused.append(error)
                raise

    assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 3
    assert len(refused) == 1
    assert inbox(dsn) == {"e1": ("done", 0), "e2": ("pending", 1), "e3": ("done", 0)}
    assert stored(dsn) == (["e1", "e3"], [])
    # After the batch, the engine's connection commits as usual.
    with Session(engine) as session:
        session.add(Order(key="later"))
        session.commit()
    assert stored(dsn) == (["e1", "e3", "later"], [])
