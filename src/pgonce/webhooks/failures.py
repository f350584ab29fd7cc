"""How a failed inbox handler is reported, in one set of words for every place that runs one.

The async worker (:mod:`pgonce.webhooks.worker`) and the sync batches of the ORM adapters
(:mod:`pgonce.webhooks.batch`) log a failure alike: the source, the event, the error and what
happens next (the retry's time, or the dead letter and the command that replays it), at error
level for a dead letter and warning level for a retry, through a
:class:`~pgonce.core.throttle.Throttle` so that a source whose every event fails writes a line a
minute, not a line an event.
"""

from __future__ import annotations

import logging
from datetime import datetime

from pgonce.core.inbox import DeadLetter, InboxEvent, Retry, describe_error, next_step
from pgonce.core.throttle import Throttle, held_back

__all__ = ["log", "report_failure"]

log = logging.getLogger("pgonce.inbox")


def report_failure(
    throttle: Throttle,
    event: InboxEvent,
    error: BaseException,
    decision: Retry | DeadLetter,
    now: datetime,
) -> None:
    """Log that ``event``'s handler raised ``error`` and what ``decision`` does next, unless
    ``throttle`` holds this kind back (the source, the exception's type, dead or not)."""
    dead = isinstance(decision, DeadLetter)
    held = throttle.admit((event.source, type(error).__qualname__, dead), now)
    if held is None:
        return
    (log.error if dead else log.warning)(
        "inbox: the handler of %s event %s failed: %s; %s%s",
        event.source,
        event.id,
        describe_error(error),
        next_step(event, decision),
        held_back(held),
    )
