"""The inbox's pure decisions: what a delivery is, how a stored outcome is answered, when a failed
event is retried, when it is dead-lettered, and which events the out-of-order policy drops.

Nothing here does I/O; time and randomness come in as parameters (``now``, ``jitter``), so every
rule is tested without a database or a clock.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pgonce.core.backoff import capped_exponential
from pgonce.core.checks import check_duration, describe, storable_text
from pgonce.core.frozen import refuse_changes
from pgonce.errors import BadPayload, UsageError

#: Longest event id, in UTF-8 bytes (the table's CHECK constraint says the same). Providers' ids are
#: far shorter (Stripe ~30, GitHub 36); anything longer is not an id but an attack on the index.
MAX_EVENT_ID_BYTES = 512

#: Longest ``last_error`` kept: enough for an exception type and a useful message, small enough
#: that a handler raising with a whole payload in its message cannot bloat the table.
MAX_ERROR_CHARS = 2000

#: Request headers never stored with a delivery: credentials of our own edge, not the provider's
#: signature, and not needed to verify the delivery again.
UNSTORED_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
#: Words that name a credential in a header's name (GitLab's ``x-gitlab-token``, an
#: ``x-api-key``, an ``x-webhook-secret``): where a scheme does not list the headers it reads,
#: such a header is not stored either, since for a shared-token scheme its value IS the secret.
CREDENTIAL_WORDS = ("token", "secret", "password", "api-key", "apikey", "auth", "cookie", "session")

StoreOutcome = Literal["stored", "duplicate", "conflict", "gone"]
Status = Literal["pending", "done", "dead", "skipped"]
OutOfOrderPolicy = Literal["process", "drop"]
HeadFailurePolicy = Literal["block", "park"]


@refuse_changes
@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often a failing handler is retried, and how far apart.

    The delay before attempt ``n + 1`` is ``min(cap, base * 2 ** (n - 1))``, of which the upper
    half is random ("equal jitter"): retries of events that failed together spread out, and no
    retry comes sooner than half the computed delay.
    """

    #: Handler runs before the event is dead-lettered. Ten runs with the default base and cap span
    #: about 1.5 hours: long enough to ride out a deploy or a short outage of a dependency.
    attempts: int = 10
    #: The first retry's delay: a few seconds, so a transient failure (a lock timeout, a restart of
    #: the forward target) is retried almost at once.
    base: timedelta = timedelta(seconds=5)
    #: The longest delay between two runs, so a late attempt is not postponed for days.
    cap: timedelta = timedelta(minutes=30)

    def __post_init__(self) -> None:
        # Types first: a str or a number of seconds would otherwise fail as a TypeError here, or
        # (a float) only at the first failure of a handler, far from the mistake.
        if type(self.attempts) is not int:
            raise UsageError(
                f"a retry policy's attempts must be a whole number, not {describe(self.attempts)}"
            )
        check_duration(self.base, "a retry policy's base")
        check_duration(self.cap, "a retry policy's cap")
        if self.attempts < 1:
            raise UsageError("a retry policy needs at least one attempt")
        if self.base <= timedelta(0) or self.cap < self.base:
            raise UsageError("a retry policy needs 0 < base <= cap")


def backoff(policy: RetryPolicy, attempts: int, jitter: float) -> timedelta:
    """The delay after the ``attempts``-th failed run; ``jitter`` is a number in [0, 1)."""
    if not 0.0 <= jitter < 1.0:
        raise UsageError("jitter must be in [0, 1)")
    delay = capped_exponential(policy.base, policy.cap, attempts)
    return delay / 2 + delay / 2 * jitter


@refuse_changes
@dataclass(frozen=True, slots=True)
class Retry:
    """Run the handler again at ``at``."""

    at: datetime
    status: Literal["pending"] = field(default="pending", init=False)


@refuse_changes
@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Stop: the event is dead-lettered with its last error, until someone replays it."""

    status: Literal["dead"] = field(default="dead", init=False)


def after_failure(
    policy: RetryPolicy, attempts_before: int, *, now: datetime, jitter: float | None = None
) -> Retry | DeadLetter:
    """What happens to an event whose handler just failed, having run ``attempts_before`` times
    before this run. ``jitter`` defaults to a random number."""
    attempts = attempts_before + 1
    if attempts >= policy.attempts:
        return DeadLetter()
    spread = random.random() if jitter is None else jitter
    return Retry(now + backoff(policy, attempts, spread))


def next_step(event: InboxEvent, decision: Retry | DeadLetter) -> str:
    """What happens to ``event`` after a failed run, in words for the log line that reports it."""
    if isinstance(decision, DeadLetter):
        return (
            f"dead-lettered after {event.attempts + 1} attempts; replay it with "
            f"`pgonce replay --source {event.source} --event-id {event.id}` once the cause is "
            "fixed"
        )
    at = decision.at.astimezone(UTC)
    return f"attempt {event.attempts + 1}, retry at {at:%Y-%m-%d %H:%M:%S}Z"


def describe_error(error: BaseException) -> str:
    """``"<type>: <message>"`` of a handler's exception, truncated to :data:`MAX_ERROR_CHARS`, as
    the inbox's text column can store it."""
    try:
        message = str(error)
    except Exception:
        # Its __str__ raised (as some exceptions do once unpickled): describing the failure must
        # not fail in turn, out of the worker's batch and its loop.
        message = "<its str() raised>"
    text = storable_text(message.strip())
    described = f"{type(error).__qualname__}: {text}" if text else type(error).__qualname__
    if len(described) > MAX_ERROR_CHARS:
        described = described[: MAX_ERROR_CHARS - 1] + "…"
    return described


def digest(body: bytes) -> bytes:
    """SHA-256 of a delivery's raw body: what tells a duplicate from a conflict."""
    return hashlib.sha256(body).digest()


def _storable_text(text: object, what: str) -> str:
    """``text`` when PostgreSQL can store it as a key: a non-empty str, valid UTF-8 (no lone
    surrogates, which JSON can smuggle in), no NUL, at most :data:`MAX_EVENT_ID_BYTES` bytes."""
    if not isinstance(text, str) or not text:
        raise BadPayload(f"the {what} is empty or not text")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadPayload(f"the {what} is not valid Unicode") from None
    if size > MAX_EVENT_ID_BYTES:
        raise BadPayload(f"the {what} is longer than {MAX_EVENT_ID_BYTES} bytes")
    if "\x00" in text:
        raise BadPayload(f"the {what} contains a NUL character")
    return text


def validate_event_id(event_id: str) -> str:
    """The id itself, or :class:`BadPayload` when it cannot be stored as an id."""
    return _storable_text(event_id, "event id")


def integer_text(value: object) -> str | None:
    """The decimal text of an integer id (Shopify's and many providers' ids are JSON numbers),
    ``None`` for anything else: a bool is no object's id, and a float's text is not stable."""
    return str(value) if type(value) is int else None


def validate_ordering(ordering: Ordering) -> Ordering:
    """The ordering itself, or :class:`BadPayload` when its key or version cannot be stored.

    An integer key (Shopify's and many providers' object ids are JSON numbers) names its object
    by its decimal text: ``Ordering(payload["id"])`` works as ``Ordering(str(payload["id"]))``,
    instead of every delivery of the source being refused.
    """
    version = ordering.version
    key = integer_text(ordering.key)  # an untyped extractor's value
    if key is not None:
        ordering = Ordering(key, version)
    _storable_text(ordering.key, "ordering key")
    if version is not None and (
        isinstance(version, bool) or not isinstance(version, int) or not -(2**63) <= version < 2**63
    ):
        raise BadPayload("the ordering version is not a 64-bit integer")
    return ordering


def parse_json(body: bytes) -> Any:
    """The JSON document of a body, or :class:`BadPayload` (not UTF-8, or not JSON)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadPayload("the body is not UTF-8") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise BadPayload("the body is not valid JSON") from None


def stored_headers(
    headers: Mapping[str, str], needed: Collection[str] | None = None
) -> dict[str, str]:
    """The headers kept with a delivery: those the scheme reads (``needed``, lower-case names)
    plus ``content-type``, or, when the scheme does not say, all but credentials: our own edge's,
    and any header whose name has a word of :data:`CREDENTIAL_WORDS`.
    A value with a NUL character is left out: no HTTP server passes one on, and jsonb cannot hold
    it."""
    if needed is not None:
        keep = {*needed, "content-type"}
        chosen = {name: value for name, value in headers.items() if name in keep}
    else:
        chosen = {
            n: v
            for n, v in headers.items()
            if n not in UNSTORED_HEADERS and not any(word in n for word in CREDENTIAL_WORDS)
        }
    return {name: value for name, value in chosen.items() if "\x00" not in value + name}


@refuse_changes
@dataclass(frozen=True, slots=True)
class Ordering:
    """Where an event stands among events about the same object.

    ``key`` names the object (for example a Stripe object id): events with the same key are
    processed one at a time, in arrival order as stored (two deliveries stored by concurrent
    transactions may run in either order). ``version`` (an object version, or a timestamp as an
    integer) lets the out-of-order policy ``"drop"`` skip events older than the last applied one,
    whatever the timing.
    """

    #: The object's name; an integer id is taken as its decimal text (:func:`validate_ordering`).
    key: str
    version: int | None = None


@refuse_changes
@dataclass(frozen=True, slots=True)
class Delivery:
    """A verified delivery, ready to be stored."""

    source: str
    event_id: str
    body: bytes
    headers: Mapping[str, str]
    digest: bytes
    ordering: Ordering | None = None


@refuse_changes
@dataclass(frozen=True, slots=True)
class InboxEvent:
    """An event as a handler gets it.

    ``payload`` is the parsed JSON when the source requires JSON, else ``None`` (``body`` always
    holds the raw bytes). ``attempts`` counts the runs that ended before this one.
    """

    source: str
    id: str
    body: bytes
    headers: Mapping[str, str]
    attempts: int
    received_at: datetime
    ordering_key: str | None = None
    version: int | None = None
    payload: Any = None


def answer(outcome: StoreOutcome) -> int:
    """The HTTP status of a store outcome: a duplicate is acknowledged like the original."""
    return {"stored": 200, "duplicate": 200, "conflict": 409, "gone": 503}[outcome]


def needs_watermark(policy: OutOfOrderPolicy, event: InboxEvent) -> bool:
    """Whether the event's version must be checked against its key's watermark."""
    return policy == "drop" and event.ordering_key is not None and event.version is not None
