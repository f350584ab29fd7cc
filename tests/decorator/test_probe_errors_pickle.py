"""The errors a decorated function raises cross a process boundary, as a process pool sends them.

``KeyMismatch``, ``KeyInFlight`` (and ``LeaseLost``, ``MissingExtra``, ``HandlerTimeout``) take
other arguments than a message, and Python rebuilt an exception from its message alone: unpickling
one failed with a TypeError. A decorated message handler run in a ``ProcessPoolExecutor`` whose
key was in flight broke the whole pool (``BrokenProcessPool``) instead of raising
``KeyInFlight`` in the parent for the message to be requeued; ``copy.copy()`` failed alike. So
did every error of pgonce whose ``__init__`` takes other arguments, an adapter's too.
"""

from __future__ import annotations

import concurrent.futures
import copy
import multiprocessing
import pickle
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce import idempotent
from pgonce.contrib.sqlalchemy import BlockCommitRefused, TransactionEndRefused
from pgonce.errors import (
    ConfigError,
    HandlerTimeout,
    KeyInFlight,
    KeyMismatch,
    LeaseLost,
    MissingExtra,
    PgonceError,
)
from pgonce.webhooks.worker import HandlerNotAsync

SCOPE = "held-across-processes"


def _ship_plain(conn: psycopg.Connection[Any], k: str) -> str:
    return k


#: The handler, run in a pool's process; and the same call joined, which holds the key.
_ship = idempotent(key="k", scope=SCOPE, commit=True, wait=timedelta(milliseconds=100))(_ship_plain)
_ship_joined = idempotent(key="k", scope=SCOPE)(_ship_plain)


def _ship_in_a_process(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return _ship(conn, "o-1")


def test_key_in_flight_in_a_process_pool_reaches_the_parent(dsn: str) -> None:
    context = multiprocessing.get_context("spawn")
    with (
        psycopg.connect(dsn) as holder,
        concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool,
    ):
        assert _ship_joined(holder, "o-1") == "o-1"  # not committed: the key is held
        with pytest.raises(KeyInFlight) as raised:
            pool.submit(_ship_in_a_process, dsn).result(timeout=60)
        assert pool.submit(str, 1).result(timeout=60) == "1"  # the pool goes on
        holder.rollback()
    assert (raised.value.scope, raised.value.key) == (SCOPE, "o-1")


ERRORS: list[PgonceError] = [
    KeyMismatch("s", "k"),
    KeyInFlight("s", "k", 3, "locked"),
    LeaseLost("s", "k", 7),
    MissingExtra("server", "the service", "uvicorn"),
    HandlerTimeout(2.5),
    BlockCommitRefused(),
    TransactionEndRefused("commit"),
    HandlerNotAsync("stripe", 1),
    ConfigError("a message"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_each_error_survives_pickle_and_copy(error: PgonceError) -> None:
    error.add_note("a note")
    for made in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(made) is type(error)
        assert str(made) == str(error)
        assert vars(made) == vars(error)
