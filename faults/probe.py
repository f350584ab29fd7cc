"""Clients that time every answer, for the recovery figures of the topology scenarios.

A probe is one client sending one request at a time, as a provider's or an API client's retry loop
would: each request is retried with the same event id (or Idempotency-Key) until it succeeds; a
transport error (a reset keep-alive connection, a timeout) is an answer like any other, counted,
retried, never a crash. Every attempt is kept with the time it was sent and answered, which is what
the figures come from: the longest time without a success, the longest wait for any answer, and the
first success after a moment (the new primary accepting writes).

The probes build their requests, and are accounted, by the load's own producers
(:class:`~faults.load.WebhookLoad`, :class:`~faults.load.PaymentLoad`) run one request at a time:
their effects are checked in the database exactly like the load's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field

import httpx

from faults.load import RETRY_PAUSE, PaymentLoad, WebhookLoad

#: A request without an answer after this long is given up and retried (a client's timeout).
CLIENT_TIMEOUT = 10.0


@dataclass(frozen=True)
class Attempt:
    sent: float
    answered: float
    #: The status code, or None for a transport error (no answer).
    status: int | None


@dataclass
class Timeline:
    """Every attempt of one probe, in the order they were sent (``time.monotonic()`` seconds)."""

    name: str
    success: int
    attempts: list[Attempt] = field(default_factory=list)

    def successes(self) -> list[float]:
        return [a.answered for a in self.attempts if a.status == self.success]

    def longest_without_success(self, since: float, until: float) -> float:
        """The longest stretch between ``since`` and ``until`` with no successful answer."""
        marks = [since, *(t for t in self.successes() if since < t < until), until]
        return max(b - a for a, b in itertools.pairwise(marks))

    def longest_wait(self) -> float:
        """The longest any single attempt waited for its answer (or its transport error)."""
        return max((a.answered - a.sent for a in self.attempts), default=0.0)

    def first_success_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the first successful answer after it."""
        later = [t for t in self.successes() if t >= moment]
        return min(later) - moment if later else None

    def transport_errors(self) -> int:
        return sum(1 for a in self.attempts if a.status is None)


class Probes:
    """A webhook probe against the service and a payments probe against the app, each one
    request at a time, until :meth:`stop`."""

    def __init__(self, hooks: WebhookLoad, pays: PaymentLoad) -> None:
        self.hooks = hooks
        self.pays = pays
        self.webhooks = Timeline("webhooks", 200)
        self.payments = Timeline("payments", 201)
        self._stop = asyncio.Event()
        self._deadline = float("inf")
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._lane(self.webhooks, self.hooks)),
            asyncio.create_task(self._lane(self.payments, self.pays)),
        ]

    async def stop(self, drain_seconds: float = 120) -> None:
        """Stop sending new requests; each probe goes on retrying the request it is on, for at
        most ``drain_seconds``."""
        self._deadline = time.monotonic() + drain_seconds
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _lane(self, timeline: Timeline, load: WebhookLoad | PaymentLoad) -> None:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
            while not self._stop.is_set():
                n = load.next
                load.next += 1
                if isinstance(load, WebhookLoad):
                    body, headers = load.delivery(n)
                else:
                    body, headers = load.request(n)
                while time.monotonic() < self._deadline:
                    sent = time.monotonic()
                    response = None
                    with contextlib.suppress(httpx.HTTPError):
                        response = await client.post(load.url, content=body, headers=headers)
                    status = None if response is None else response.status_code
                    timeline.attempts.append(Attempt(sent, time.monotonic(), status))
                    load.statuses[f"{timeline.name} {status or 'no answer'}"] += 1
                    if response is not None and status == timeline.success:
                        if isinstance(load, WebhookLoad):
                            load.acked.add(n)
                        else:
                            load.first.setdefault(n, response.content)
                        break
                    if response is not None and status not in (409, 503):
                        load.bodies.append(response.content)
                    await asyncio.sleep(RETRY_PAUSE)
