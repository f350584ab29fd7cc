"""A process_batch() handler that runs COMMIT or ROLLBACK in SQL through its session, on a real
database: the batch stops there, and no event stays done whose handler's writes did not commit
with it, nor runs again after its handler committed."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from pgonce.contrib.sqlalchemy import process_batch
from pgonce.core.inbox import InboxEvent
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.test_inbox_sync import POLICY, T0, deliver, inbox


@pytest.mark.parametrize("end", ["COMMIT", "ROLLBACK"])
def test_a_handlers_sql_end_of_the_batch_loses_and_repeats_nothing(
    dsn: str, engine: Engine, end: str
) -> None:
    deliver(dsn, "e1", "e2", "e3")

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.id))
        session.flush()
        if event.id == "e2":
            session.execute(text(end))
            raise RuntimeError("the handler's own error")

    process_batch(engine, "shop", handle, retry=POLICY, now=T0)
    with psycopg.connect(dsn) as conn:
        error = conn.execute("SELECT last_error FROM pgonce.inbox WHERE event_id = 'e2'").fetchone()
    assert error is not None
    assert error[0].startswith("HandlerEndedTransaction")
    assert "the handler's own error" in error[0]
    if end == "COMMIT":
        assert inbox(dsn) == {"e1": ("done", 0), "e2": ("dead", 1), "e3": ("pending", 0)}
        assert stored(dsn)[0] == ["e1", "e2"]
    else:
        assert inbox(dsn) == {"e1": ("pending", 0), "e2": ("pending", 1), "e3": ("pending", 0)}
        assert stored(dsn)[0] == []
