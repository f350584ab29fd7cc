"""A heartbeat whose renewals failed (the database away) and that then finds the key taken over.
Its end was logged as "the call's record tells whether the key is still this holder's", though
the heartbeat knew it was not: the run of failures ends with the takeover, and says so."""

from __future__ import annotations

import threading
from datetime import timedelta

import psycopg
import pytest

from pgonce import LeaseLost
from pgonce.store.heartbeat import Heartbeat

BEAT = timedelta(milliseconds=10)


def test_a_run_of_failures_that_ends_with_a_takeover_logs_the_takeover(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lost = threading.Event()
    count = [0]

    def renew() -> None:
        count[0] += 1
        if count[0] < 3:
            raise psycopg.OperationalError("the server closed the connection")
        lost.set()
        raise LeaseLost("t", "k", 1)

    with caplog.at_level("DEBUG", logger="pgonce.phases"), Heartbeat(renew, BEAT) as heartbeat:
        assert lost.wait(timeout=10)
    assert heartbeat.lost
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "tells whether the key is still this holder's" in m]
    ends = [r for r in caplog.records if "taken over" in r.getMessage()]
    assert len(ends) == 1
    assert ends[0].levelname == "WARNING"
    assert "after 2 failed renewals" in ends[0].getMessage()
