"""The heartbeat of a two-phase holder: its lease renewed in the background while a call runs.

A third party's call runs outside any transaction and may outlast the lease (a provider that
answers slowly, a retry inside the client library). While it runs, the heartbeat renews the lease
every ``every`` on the holder's idle connection, fenced by the holder's token like every other
write, and stops when the call returns or raises, before anything else uses the connection.

What both twins guarantee (one with an asyncio task for ``_async/phases.py``, one with a thread
for the ``_sync`` file generated from it, which names :class:`Heartbeat` where the source names
:class:`AsyncHeartbeat`):

- A renewal refused because the key was taken over (:class:`~pgonce.errors.LeaseLost`) ends the
  heartbeat and sets :attr:`lost`: the call's result must then not be recorded.
- Any other failure of a renewal (the database away for a moment) is counted in :attr:`failures`
  and the next beat tries again: the lease lasts several beats, and a holder that cannot renew for
  a whole lease is fenced by its token anyway. The first failure of a run of them is logged as a
  warning that says so, the others at debug level, and the renewal that ends the run once more
  (or the takeover a renewal found, or, when the call ends first, the heartbeat's stop).
- A renewal that failed because the holder's connection is gone for good (``closed``, given by
  the holder: the server restarted or failed over, and a psycopg connection never reconnects)
  ends the heartbeat with one warning that says so: no later beat could renew on it, and the
  call's record fails on it too.
- A renewal that raises :class:`~pgonce.errors.UsageError` (a ``clock`` that gives a naive
  datetime) is a broken contract, not an outage: it ends the heartbeat and is kept in
  :attr:`error`, for the call to raise once its work returns.
- Leaving the ``with`` block waits for a renewal under way to end, so the connection is idle
  again when the block is left.

:class:`AsyncCallback` and :class:`Callback` are the twins' other difference: the work a caller
hands to a phase or a call must be a coroutine function for the async store and a plain function
for the sync one, and the wrong kind is refused where it is called, with a message that says so.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from datetime import timedelta
from types import TracebackType
from typing import TypeVar

from pgonce.core.outage import FailureRun
from pgonce.errors import LeaseLost, UsageError

Value = TypeVar("Value")

log = logging.getLogger("pgonce.phases")

#: The name of the heartbeat's task or thread (shown by debuggers and thread dumps).
NAME = "pgonce-heartbeat"


class _Beats:
    """What both twins keep of their renewals: a lost key, and the failures counted and logged
    once per run of them."""

    def __init__(self, every: timedelta, closed: Callable[[], bool] | None = None) -> None:
        self._every = every
        self._closed = closed
        self._failed = FailureRun(
            log, "a lease's heartbeat renewed the lease again after %(count)d failures"
        )
        #: Renewals that failed (the database away) since the heartbeat started.
        self.failures = 0
        #: True once a renewal found the key taken over by another holder.
        self.lost = False
        #: A renewal's broken contract (:class:`~pgonce.errors.UsageError`): it ended the beats.
        self.error: UsageError | None = None

    def _after(self, error: Exception | None) -> bool:
        """Records one renewal's outcome; true when the heartbeat ends (the key was lost, or the
        renewal was misused and would fail the same way every time)."""
        if isinstance(error, LeaseLost):
            self.lost = True
            if in_a_row := self._failed.ended():
                # The run's first warning said the key stays this holder's: it did not.
                log.warning(
                    "a lease's heartbeat found the key taken over after %d failed renewals in a "
                    "row: the call's value is not recorded",
                    in_a_row,
                )
            return True
        if isinstance(error, UsageError):
            log.error(
                "a lease's heartbeat stopped: %s; the call fails once its work returns", error
            )
            self.error = error
            return True
        if error is None:
            self._failed.succeeded()
            return False
        self.failures += 1
        if self._closed is not None and self._closed():
            self._failed.ended()
            log.warning(
                "a lease's heartbeat lost its connection (%s: %s), and stops: no renewal can "
                "succeed on it, and the call's value cannot be recorded on it; the key is "
                "another holder's to take over once its lease runs out, and a retry calls again "
                "with the same idempotency key",
                type(error).__name__,
                error,
            )
            return True
        self._failed.failed(
            error,
            "a lease's heartbeat failed (%(type)s: %(error)s); it tries again every %(every)s, "
            "and the key stays this holder's until its lease runs out",
            "a lease's heartbeat failed again (%(count)d in a row): %(error)s",
            {"every": self._every},
        )
        return False

    def _stopped(self) -> None:
        """The heartbeat ended: a run of failures still under way ends here, and says so (its
        first warning promised further tries)."""
        if in_a_row := self._failed.ended():
            log.warning(
                "a lease's heartbeat stopped after %d failed renewals in a row: the call's "
                "record tells whether the key is still this holder's",
                in_a_row,
            )


class AsyncHeartbeat(_Beats):
    """Runs ``renew()`` every ``every`` in an asyncio task while the ``async with`` block runs;
    ``closed()`` says whether the connection it renews on is gone for good."""

    def __init__(
        self,
        renew: Callable[[], Awaitable[None]],
        every: timedelta,
        closed: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(every, closed)
        self._renew = renew
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self._every.total_seconds())
                return
            except TimeoutError:
                pass
            try:
                await self._renew()
            except Exception as error:
                if self._after(error):
                    return
            else:
                self._after(None)

    async def __aenter__(self) -> AsyncHeartbeat:
        self._task = asyncio.create_task(self._beat(), name=NAME)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        assert self._task is not None
        # A renewal under way ends first (one short statement at most), so that the connection
        # is idle when it is used next; a caller cancelled meanwhile cancels the task with it.
        await self._task
        self._stopped()


class Heartbeat(_Beats):
    """Runs ``renew()`` every ``every`` in a thread while the ``with`` block runs; ``closed()``
    says whether the connection it renews on is gone for good."""

    def __init__(
        self, renew: Callable[[], None], every: timedelta, closed: Callable[[], bool] | None = None
    ) -> None:
        super().__init__(every, closed)
        self._renew = renew
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=NAME, daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self._every.total_seconds()):
            try:
                self._renew()
            except Exception as error:
                if self._after(error):
                    return
            else:
                self._after(None)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._stopped()


class AsyncCallback:
    """The result of a caller's work for the async store: it must be awaitable."""

    @staticmethod
    def check(work: object, what: str) -> None:
        """Nothing to refuse before the call: a plain function that returns an awaitable (a
        lambda, a wrapper) is as good as a coroutine function, so only its result tells."""

    @staticmethod
    async def result(value: Awaitable[Value], what: str) -> Value:
        if not inspect.isawaitable(value):
            raise UsageError(
                f"{what} returned {type(value).__name__}, not an awaitable: the async store "
                "takes a coroutine function (async def); use PhaseStore for plain functions"
            )
        return await value


class Callback:
    """The result of a caller's work for the sync store: it must not be awaitable."""

    @staticmethod
    def check(work: object, what: str) -> None:
        """Refuse a coroutine function before anything is taken over, written or called: its
        result (never awaited) would fail only once the work was due, a call then counting as
        made and a completer's request as failed, until the completer retired it."""
        if inspect.iscoroutinefunction(work):
            raise UsageError(
                f"{what} is a coroutine function (async def), which would have returned an "
                "awaitable: the sync store takes a plain function; use AsyncPhaseStore for it"
            )

    @staticmethod
    def result(value: Value, what: str) -> Value:
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()  # never awaited: no "was never awaited" warning on top
            raise UsageError(
                f"{what} returned an awaitable: the sync store takes a plain function; use "
                "AsyncPhaseStore for a coroutine function"
            )
        return value
