"""FailureRun, the one "a run of failures logged once" of pgonce's background loops, without a
database: the lines it writes and the failures it hands on."""

from __future__ import annotations

import logging

import pytest

from pgonce.core.outage import FailureRun

log = logging.getLogger("pgonce.test-outage")


def test_a_run_is_one_warning_debug_lines_with_the_count_and_one_line_at_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[Exception] = []
    run = FailureRun(log, "the loop works again after %(count)d failures", seen.append)
    first, again = "%(what)s failed (%(type)s: %(error)s); retried", "again (%(count)d): %(error)s"
    with caplog.at_level(logging.DEBUG, logger=log.name):
        run.succeeded()  # no run under way: nothing to say
        for n in range(3):
            run.failed(OSError(f"down {n}"), first, again, {"what": "the loop"})
        run.succeeded()
        run.succeeded()
        run.failed(OSError("down again"), first, again, {"what": "it"}, level=logging.ERROR)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "the loop failed (OSError: down 0); retried"),
        (logging.DEBUG, "again (2): down 1"),
        (logging.DEBUG, "again (3): down 2"),
        (logging.INFO, "the loop works again after 3 failures"),
        (logging.ERROR, "it failed (OSError: down again); retried"),
    ]
    assert [str(e) for e in seen] == ["down 0", "down 1", "down 2", "down again"]
    assert run.ended() == 1
    assert run.ended() == 0
