"""Wrong arguments to an inbox worker are refused at the call with a UsageError that names them,
rather than as an AttributeError or TypeError out of run() once its loops started (a dsn that is
not a str; a hook or clock that cannot be called, after a batch already committed), or a run()
that never returns (a threading.Event as its stop blocks the event loop in its wait())."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from pgonce.errors import UsageError
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"dsn": None}, "dsn"),
        ({"dsn": b"postgresql://"}, "dsn"),
        ({"listen_dsn": 5}, "listen_dsn"),
        ({"listen": "no"}, "listen"),
        ({"clock": 5}, "clock"),
        ({"on_batch": "metrics"}, "on_batch"),
        ({"on_failure": 1}, "on_failure"),
        ({"on_connection_failure": object()}, "on_connection_failure"),
    ],
)
def test_a_wrong_argument_is_refused_at_the_call(given: dict[str, Any], named: str) -> None:
    kwargs: dict[str, Any] = {"dsn": "postgresql://localhost/db", "schema": SCHEMA, **given}
    with pytest.raises(UsageError, match=named):
        InboxWorker([source()], **kwargs)


async def test_run_refuses_a_stop_that_is_no_asyncio_event() -> None:
    worker = InboxWorker([source()], dsn="postgresql://localhost/db", schema=SCHEMA)
    stop = threading.Event()
    try:
        with pytest.raises(UsageError, match=r"asyncio\.Event"):
            # Without the check, run() blocks its event loop in stop.wait(), which no timeout
            # can end: it runs in a thread of its own, awaited with a deadline.
            running = asyncio.to_thread(asyncio.run, worker.run(stop))  # type: ignore[arg-type]
            await asyncio.wait_for(running, 10)
    finally:
        stop.set()  # lets a blocked thread go
