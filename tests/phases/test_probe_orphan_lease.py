"""A lease whose key row is gone is the past of a key, not a holder of it. The key store's
``release()`` of a two-phase claim (a team mixing the two stores on one key), or a hand's DELETE
of the key, left the lease row behind; every later two-phase claim of the key then failed with a
DatabaseError on the lease's primary key, for ever. The claim that makes the key anew replaces
such a row, with a token above the old holder's, whose writes are then refused."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import KeyStore, LeaseLost
from pgonce.phases import PhaseStore
from tests.phases.racer import FP, T0


def test_a_key_released_by_the_key_store_can_be_claimed_again_in_two_phases(
    db: psycopg.Connection[Any],
) -> None:
    store = PhaseStore()
    first = store.start(db, "t", "mixed", FP, now=T0)
    assert first.won
    with db.transaction():
        KeyStore().release(db, first.claim)  # type: ignore[arg-type]
    again = store.start(db, "t", "mixed", FP, now=T0)
    assert again.won
    # The holder from before the release writes nothing over the new one.
    with pytest.raises(LeaseLost):
        first.phase("charged", lambda conn: {"id": "ch_1"}, now=T0)
    assert again.phase("charged", lambda conn: {"id": "ch_2"}, now=T0) == {"id": "ch_2"}


def test_a_key_deleted_by_hand_can_be_claimed_again_in_two_phases(
    db: psycopg.Connection[Any],
) -> None:
    store = PhaseStore()
    before = store.start(db, "t", "deleted", FP, now=T0)
    before.phase("charged", lambda conn: {"id": "ch_1"}, now=T0)
    db.execute("DELETE FROM pgonce.keys WHERE scope = 't' AND key = 'deleted'")
    again = store.start(db, "t", "deleted", FP, now=T0)
    assert again.won
    assert not again.reached("charged")
