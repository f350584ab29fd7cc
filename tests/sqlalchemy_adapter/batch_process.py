"""process_batch() in a process of its own, for the kill -9 test.

``python -m tests.sqlalchemy_adapter.batch_process DSN`` runs one batch whose handler adds its
order through the Session, flushes it, prints ``STARTED <event id>`` and then blocks forever: the
test kills the process at that moment, inside the batch's open transaction.
"""

from __future__ import annotations

import sys
import threading

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from pgonce.contrib.sqlalchemy import process_batch
from pgonce.core.inbox import InboxEvent
from tests.keys.helpers import sqlalchemy_url
from tests.sqlalchemy_adapter.models import Order

#: The killed process's connections, for the test to find their backends.
APPLICATION_NAME = "pgonce-batch-killed"


def blocking_handler(event: InboxEvent, session: Session) -> None:
    session.add(Order(key=event.id))
    session.flush()
    print(f"STARTED {event.id}", flush=True)
    threading.Event().wait()


def main(dsn: str) -> None:
    url = sqlalchemy_url(dsn).update_query_dict({"application_name": APPLICATION_NAME})
    process_batch(create_engine(url), "shop", blocking_handler)


if __name__ == "__main__":
    main(sys.argv[1])
