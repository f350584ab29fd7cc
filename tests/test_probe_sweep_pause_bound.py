"""SweepLimits bounds its pause where the library takes it, not only on the command line."""

from __future__ import annotations

from datetime import timedelta

import pytest

from pgonce.core.retention import MAX_PAUSE, SweepLimits
from pgonce.errors import ConfigError


def test_a_pause_beyond_a_day_is_refused_at_construction() -> None:
    # It was taken, and the run ended in an OverflowError after its first batch had deleted rows.
    with pytest.raises(ConfigError, match=r"at most 1 day.*cron"):
        SweepLimits(pause=timedelta(days=30_000_000))


def test_a_pause_of_a_day_is_taken() -> None:
    assert SweepLimits(pause=MAX_PAUSE).pause == MAX_PAUSE
