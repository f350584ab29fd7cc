"""The throttle that keeps a broken broker or handler from flooding the log: the first report of a
kind at once, then one per interval with the count held back in between; kinds are independent."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pgonce.core import throttle
from pgonce.core.throttle import Throttle, held_back

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def test_one_report_per_kind_per_interval_with_the_count_held_back() -> None:
    gate = Throttle(timedelta(minutes=1))
    assert gate.admit(("order", "unroutable"), T0) == 0
    assert gate.admit(("order", "unroutable"), T0 + timedelta(seconds=1)) is None
    assert gate.admit(("order", "unroutable"), T0 + timedelta(seconds=59)) is None
    # Another kind is not held back by the first.
    assert gate.admit(("invoice", "unroutable"), T0 + timedelta(seconds=2)) == 0
    assert gate.admit(("order", "unroutable"), T0 + timedelta(seconds=60)) == 2
    assert gate.admit(("order", "unroutable"), T0 + timedelta(seconds=61)) is None


def test_the_suffix_says_how_many_were_held_back() -> None:
    assert held_back(0) == ""
    assert held_back(3) == " (3 more like it since the last report)"


def test_the_kinds_remembered_are_bounded() -> None:
    gate = Throttle()
    for n in range(throttle.MAX_KINDS + 10):
        assert gate.admit(n, T0) == 0
    assert len(gate._last) == throttle.MAX_KINDS
    # The oldest were forgotten: they are reported again, the newest are still held back.
    assert gate.admit(0, T0) == 0
    assert gate.admit(throttle.MAX_KINDS + 9, T0) is None
