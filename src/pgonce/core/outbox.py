"""The outbox relay's decisions, without I/O: backoff, parking, and what a broker's answer means.

A delivery ends in one of three ways for each row: the broker **acknowledged** it (mark it
published), **refused** it (count an attempt; retry after a backoff; park it after the configured
attempts), or it stayed **unsettled** (the broker was unreachable or the answer was lost: the row
waits, no attempt is counted, so an outage never parks anything).

Order per aggregate: the relay publishes an aggregate's rows in id order and :func:`settle` records
a refusal only for the first row of an aggregate that was not acknowledged; the rows after it stay
pending behind it. A row the broker acknowledged is marked published even when an earlier row of
its aggregate was refused in the same batch (it is on the broker already; withholding the mark
would only add a duplicate), and :attr:`Settlement.out_of_order` counts those rare cases.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from pgonce.core.backoff import capped_exponential
from pgonce.core.checks import check_bool, check_optional_time, storable_text
from pgonce.core.frozen import refuse_changes
from pgonce.errors import ConfigError, UsageError

#: Refused deliveries before a row is parked. With the default backoff (1 s doubling to a 10 min
#: cap) 12 attempts span about half an hour: long enough for a redeploy of a consumer or a rolled
#: back schema, short enough that a poison message does not sit unseen for a day.
DEFAULT_MAX_ATTEMPTS = 12
#: First retry delay: a refused message is usually refused again at once, so wait a little.
DEFAULT_BACKOFF_BASE = timedelta(seconds=1)
#: Longest retry delay: a row waits at most this long after the cause has been fixed.
DEFAULT_BACKOFF_CAP = timedelta(minutes=10)
#: +/- this fraction of random spread, so that rows refused together do not retry in lockstep.
DEFAULT_JITTER = 0.2
#: Longest ``last_error`` kept; broker messages can be long and are for people, not for parsing.
MAX_ERROR_CHARS = 1000

#: Most characters in an aggregate type or an event type, and in an aggregate id (the table's
#: CHECK constraints say the same, in bytes).
MAX_TYPE_BYTES = 255
MAX_AGGREGATE_ID_BYTES = 512


@refuse_changes
@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How refused rows are retried, and when they are parked (dead-lettered)."""

    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    base: timedelta = DEFAULT_BACKOFF_BASE
    cap: timedelta = DEFAULT_BACKOFF_CAP
    jitter: float = DEFAULT_JITTER

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be at least 1")
        if self.base <= timedelta(0) or self.cap < self.base:
            raise ConfigError("backoff needs 0 < base <= cap")
        if not 0 <= self.jitter < 1:
            raise ConfigError("jitter must be a fraction in [0, 1)")

    def delay(self, attempts: int, *, rand: float = 0.5) -> timedelta:
        """The wait after the ``attempts``-th refusal: base * 2^(attempts-1), capped, jittered.

        ``rand`` in [0, 1) picks the point in the jitter band (0.5 is no jitter), so that tests
        decide it.
        """
        raw = capped_exponential(self.base, self.cap, attempts)
        spread = 1 + self.jitter * (2 * rand - 1)
        return raw * spread


@refuse_changes
@dataclass(frozen=True, slots=True)
class Refusal:
    """What to write for a refused row: the new attempt count and either a retry time or parking."""

    id: int
    attempts: int
    next_attempt_at: datetime
    parked_at: datetime | None
    last_error: str


def refuse(
    policy: RetryPolicy,
    *,
    id: int,
    attempts_before: int,
    error: str,
    now: datetime,
    rand: float | None = None,
) -> Refusal:
    """Count one more refusal of row ``id``; park it when the policy's attempts are used up."""
    attempts = attempts_before + 1
    error = storable_text(error[:MAX_ERROR_CHARS]) or "refused"
    if attempts >= policy.max_attempts:
        return Refusal(id, attempts, now, now, error)
    jitter = random.random() if rand is None else rand
    return Refusal(id, attempts, now + policy.delay(attempts, rand=jitter), None, error)


@refuse_changes
@dataclass(frozen=True, slots=True)
class Settlement:
    """What the relay writes after a batch: published ids and refusals; the rest stays pending."""

    published: list[int] = field(default_factory=list)
    refused: list[tuple[OutboxMessage, str]] = field(default_factory=list)
    unsettled: list[int] = field(default_factory=list)
    #: Rows acknowledged after an earlier row of the same aggregate was not (see the module doc).
    out_of_order: int = 0


def settle(
    batch: Sequence[OutboxMessage], acked: frozenset[int] | set[int], refused: Mapping[int, str]
) -> Settlement:
    """Sort a published batch into published, refused and unsettled rows, per aggregate in order.

    ``batch`` is in id order. Only an aggregate's first row that was not acknowledged is
    recorded as refused: the rows behind it were published out of order (if acknowledged) or not
    yet due, and must not use up attempts for a refusal that was not theirs.
    """
    result = Settlement()
    blocked: set[tuple[str, str]] = set()
    out_of_order = 0
    for row in batch:
        aggregate = (row.aggregatetype, row.aggregateid)
        if row.id in acked:
            result.published.append(row.id)
            if aggregate in blocked:
                out_of_order += 1
            continue
        if aggregate not in blocked and row.id in refused:
            result.refused.append((row, refused[row.id]))
        else:
            result.unsettled.append(row.id)
        blocked.add(aggregate)
    return Settlement(result.published, result.refused, result.unsettled, out_of_order)


class OutboxMessage(NamedTuple):
    """One claimed outbox row, as a publisher sees it. ``id`` is the message id on every broker.

    A named tuple rather than a frozen dataclass: the relay builds one per event, and a tuple is
    built in a third of the time.
    """

    id: int
    aggregatetype: str
    aggregateid: str
    type: str
    #: The payload as the outbox stores it: JSON text (jsonb's text form), which is what the
    #: publishers send. The relay passes it through as it is; decoding it and encoding it again
    #: for every event cost a third of the relay's own time per event.
    payload_json: str
    headers: Mapping[str, str]
    created_at: datetime
    #: Refusals so far (0 on the first delivery).
    attempts: int

    @property
    def message_id(self) -> str:
        return str(self.id)

    @property
    def payload(self) -> Any:
        """The payload decoded (a new object on every access)."""
        return json.loads(self.payload_json)


class OutboxEvent(NamedTuple):
    """One event for :func:`~pgonce.store._sync.outbox.enqueue_many`: what ``enqueue`` takes for
    one (a plain tuple of the same fields is accepted too)."""

    aggregatetype: str
    aggregateid: str
    type: str
    #: Anything JSON can encode.
    payload: Any
    #: Extra message headers, str names to str values.
    headers: Mapping[str, str] | None = None


@refuse_changes
@dataclass(frozen=True, slots=True)
class OutboxBacklog:
    """What the relays have yet to do: counted from the partial indexes, cheap at any size."""

    pending: int
    #: Pending rows waiting for their backoff to pass.
    waiting: int
    parked: int
    oldest_pending: datetime | None


@refuse_changes
@dataclass(frozen=True, slots=True)
class OutboxCounts(OutboxBacklog):
    """The backlog and the published rows of the retention (a count of the whole outbox)."""

    published: int


def validate_event(aggregatetype: str, aggregateid: str, type: str) -> None:
    """Raise :class:`UsageError` for names the outbox table would refuse."""
    for what, value, limit in (
        ("aggregatetype", aggregatetype, MAX_TYPE_BYTES),
        ("aggregateid", aggregateid, MAX_AGGREGATE_ID_BYTES),
        ("type", type, MAX_TYPE_BYTES),
    ):
        if not isinstance(value, str):
            raise UsageError(f"the {what} must be a str, not {type_name(value)}")
        if "\x00" in value:
            raise UsageError(f"the {what} must not contain NUL characters")
        # UTF-8 spends at most four bytes on a character: a name of up to a quarter of the limit
        # in characters is within it, with no encoding to count its bytes (every name enqueue()
        # is given goes through here).
        if 0 < len(value) <= limit // 4:
            continue
        size = len(value.encode("utf-8", "surrogatepass"))
        if not 1 <= size <= limit:
            raise UsageError(f"the {what} must be 1 to {limit} bytes long, not {size}")


#: One event as :func:`pgonce.enqueue` writes it (the statement's parameters but the channel):
#: aggregatetype, aggregateid, type, the payload's JSON, the headers' JSON (None for no headers)
#: and the time (None for the database's clock). Made by :func:`event_row`.
EventRow = tuple[str, str, str, str, str | None, datetime | None]


def event_row(
    aggregatetype: str,
    aggregateid: str,
    type: str,
    payload: Any,
    headers: Mapping[str, str] | None,
    now: datetime | None = None,
    ordered: bool = True,
) -> EventRow:
    """The arguments of an enqueue, checked and encoded: a :class:`UsageError` for what the
    outbox table, JSON or jsonb would refuse, before any statement (one the server refused
    would abort the caller's transaction and read as a database failure). ``ordered`` is
    only checked."""
    # The checks' own tests first, so that the common case makes no call for them.
    validate_event(aggregatetype, aggregateid, type)
    if ordered is not True and ordered is not False:
        check_bool(ordered, "ordered")
    if now is not None:
        check_optional_time(now)
    # Encoded here, as the text that the statement casts to jsonb: psycopg's Jsonb wrapper would
    # look up its dumper at execute time to call the same json.dumps(). A try statement, not a
    # generator-based context manager, which costs every enqueue 11,000 client instructions
    # (python -m bench.client_instructions DSN --only outbox).
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and jsonb refuses them.
        body = json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise not_json(exc) from exc
    # None for no headers (the common case): the statement stores '{}'.
    extra = None if headers is None else json.dumps(event_headers(headers))
    # One scan in the common case: every escape jsonb refuses starts with \u.
    if "\\u" in body or extra is not None:
        check_jsonb(body, extra)
    return (aggregatetype, aggregateid, type, body, extra, now)


def event_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """An event's headers as stored: a :class:`UsageError` for anything but str to str."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise UsageError(
            f"outbox headers must be a mapping of str to str, not {type(headers).__name__}: "
            "pass a dict such as {'traceparent': '00-...'}"
        )
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise UsageError(
                "outbox headers must be str names with str values, not "
                f"{type(name).__name__}: {type(value).__name__}"
            )
    return dict(headers)


def check_jsonb(payload: str, headers: str | None) -> None:
    """Refuse what jsonb would, before the statement: the server's refusal would abort the
    caller's transaction and read as a database failure."""
    for what, text in (("payload", payload), ("headers", headers)):
        reason = None if text is None else jsonb_refusal(text)
        if reason is not None:
            raise UsageError(f"an outbox event's {what} must not contain {reason}")


def not_json(exc: TypeError | ValueError) -> UsageError:
    """What a payload that json.dumps refused is answered with."""
    return UsageError(f"an outbox payload must be JSON-encodable: {exc}")


#: An escape in json.dumps' output (ASCII, lowercase hex) that jsonb refuses: NUL, or half of a
#: surrogate pair without its other half. The backslashes before the ``u`` are counted: an even
#: run is escaped backslashes followed by the letter u, not an escape. A pair is matched first,
#: so that its halves are not taken for lone ones.
_REFUSED_ESCAPE = re.compile(
    r"(\\+)u(d[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|0000|d[89a-f][0-9a-f]{2})"
)


def jsonb_refusal(text: str) -> str | None:
    """What in ``text`` (json.dumps output) PostgreSQL's jsonb would refuse, or None.

    Checked before the statement is sent: refused by the server, the value would abort the
    caller's transaction with what reads as a database failure, where it is the caller's input.
    """
    # Two scans of C speed for the common case: no escape that can be refused.
    if "\\u0000" not in text and "\\ud" not in text:
        return None
    for match in _REFUSED_ESCAPE.finditer(text):
        if len(match.group(1)) % 2 == 0 or len(match.group(2)) > 4:
            continue
        if match.group(2) == "0000":
            return "a NUL character (\\u0000), which PostgreSQL's jsonb cannot store"
        return (
            f"a lone surrogate (\\u{match.group(2)}), which is not a character and which "
            "PostgreSQL's jsonb refuses"
        )
    return None


def type_name(value: object) -> str:
    return type(value).__name__
