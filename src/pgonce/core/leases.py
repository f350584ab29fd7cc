"""Two-phase keys without I/O: lease settings, phase names, the provider's key, the retired answer.

A two-phase claim commits at once with a lease and a fencing token; the request then runs as
phases, each recorded in its own short transaction. What is decided here needs no database: how
long a lease runs, which names a phase may take, the idempotency key a phase hands to a third
party (the same for every holder of the key, so the third party deduplicates a retried call), and
the answer stored when the completer gives up on a request.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from datetime import timedelta

from pgonce.core.checks import check_duration, check_str, storable_text
from pgonce.core.fingerprint import length
from pgonce.core.frozen import refuse_changes
from pgonce.core.outcomes import Response
from pgonce.errors import UsageError

#: How long a two-phase claim holds its key without a heartbeat: longer than one phase or one
#: third-party call normally takes (a payment provider answers within seconds and times out at
#: about 30), short enough that a retry after a crash waits no longer than a client's patience.
DEFAULT_LEASE = timedelta(seconds=30)

#: The shortest lease allowed: a lease shorter than a round trip to the database would expire
#: before the holder's first phase could renew it.
MIN_LEASE = timedelta(seconds=1)

#: The longest lease allowed: a holder silent for a day is dead, and a longer lease only keeps its
#: retry waiting; far longer ones fail late (a claim whose expiry is past PostgreSQL's last
#: timestamp, a heartbeat's wait past what a thread can sleep).
MAX_LEASE = timedelta(days=1)

#: Renewals per lease while a third party's call runs: the heartbeat renews every third of the
#: lease, so that two renewals in a row can fail (a slow commit, the database away for a moment)
#: before the lease runs out under a live holder.
HEARTBEATS_PER_LEASE = 3

#: The longest a phase name may be (it is stored as the recovery point and shown by health).
MAX_PHASE_NAME = 64

#: The longest failure note a lease records: a message echoing a provider's whole answer would
#: otherwise be stored, and shown by health, in full.
MAX_FAILURE_NOTE = 1000

#: Prefix of the third-party idempotency keys: a provider's dashboard shows where a key came from.
PROVIDER_KEY_PREFIX = "pgonce-"


def check_lease(lease: object, what: str = "a lease") -> timedelta:
    """Refuse a lease that is not a :class:`~datetime.timedelta` from :data:`MIN_LEASE` to
    :data:`MAX_LEASE`."""
    value = check_duration(lease, what)
    if value < MIN_LEASE:
        raise UsageError(
            f"{what} must be at least {MIN_LEASE.total_seconds():.0f} s: it would expire before "
            "the holder's first phase could renew it"
        )
    if value > MAX_LEASE:
        raise UsageError(
            f"{what} must be at most {MAX_LEASE} (the heartbeat renews a lease while a call "
            f"runs), not {value}: a retry would wait that long for a holder that died"
        )
    return value


def check_heartbeat(every: object, lease: timedelta) -> timedelta:
    """The heartbeat's interval: ``None`` for a third of ``lease``; else a positive
    :class:`~datetime.timedelta` shorter than the lease (a beat after the lease ran out renews
    nothing: the key may be another holder's by then)."""
    if every is None:
        return lease / HEARTBEATS_PER_LEASE
    value = check_duration(every, "the heartbeat")
    if not timedelta(0) < value < lease:
        raise UsageError(
            f"the heartbeat must be positive and shorter than the lease ({lease}), not {value}: "
            "a lease renewed less often than it lasts runs out under a live holder"
        )
    return value


def check_phase(name: object) -> str:
    """Refuse a phase name that is empty, too long, or not printable ASCII without spaces."""
    check_str(name, "a phase's name")
    assert isinstance(name, str)
    if not (0 < len(name) <= MAX_PHASE_NAME and name.isascii() and name.isprintable()) or (
        " " in name
    ):
        raise UsageError(
            f"a phase's name is 1 to {MAX_PHASE_NAME} printable ASCII characters without "
            f"spaces, not {name!r}"
        )
    return name


def provider_key(scope: str, key: str, phase: str) -> str:
    """The idempotency key that ``phase`` of the request ``(scope, key)`` gives a third party.

    Deterministic: every holder of the key (the first, a retry that took over, the completer)
    sends the same one, so the third party runs the call once. Neither the scope nor the key can
    be read back from it (a SHA-256 of the three, length-prefixed): a provider's logs learn
    nothing of the caller's keys. 47 characters, within every provider's limit (Stripe's is 255).
    """
    parts = [part.encode("utf-8", "surrogatepass") for part in (scope, key, phase)]
    digest = hashlib.sha256(b"".join(length(len(p)) + p for p in parts)).hexdigest()
    return PROVIDER_KEY_PREFIX + digest[:40]


#: The deepest nesting a recorded value may have: far beyond any provider's answer, and well
#: within what both Python's recursion and PostgreSQL's jsonb parser accept.
MAX_STATE_DEPTH = 100


def check_state(value: object, phase: str) -> None:
    """Refuse a phase's result that JSON cannot keep as it is: a resume reads it back from JSON.

    Checked before anything is written (for :meth:`call`, before the record that follows the
    third party's call; for a request's args, before the claim): a value that PostgreSQL's
    jsonb would refuse (a NUL, a lone surrogate) or give back as another type fails here, with
    the path of the part at fault, and not later as a database error or a changed type.
    """
    # First, bounded in depth: a value nested thousands deep would exhaust the recursion of
    # json.dumps and of the comparison below.
    problem = _unstorable(value, "", 0)
    if problem is not None:
        raise UsageError(f"phase {phase!r} returned a value that cannot be recorded: {problem}")
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"phase {phase!r} returned {type(value).__name__}, which is recorded as JSON and "
            f"cannot be: {error}; return a dict, list, str, int, float, bool or None"
        ) from None
    if json.loads(text) != value:
        raise UsageError(
            f"phase {phase!r} returned a value that JSON does not give back unchanged (tuples "
            "become lists, dict keys become strings): return what a resume will read"
        )


def _unstorable(value: object, path: str, depth: int) -> str | None:
    """What jsonb cannot keep unchanged in ``value`` (JSON already accepted it), with its path."""
    where = f"the value{path}"
    if depth > MAX_STATE_DEPTH:
        return f"{where} is nested more than {MAX_STATE_DEPTH} levels deep"
    if isinstance(value, str):
        return _unstorable_text(value, where)
    if isinstance(value, float) and value == 0 and math.copysign(1.0, value) < 0:
        # numeric has no negative zero: a resume would read 0.0.
        return f"{where} is a negative zero, which jsonb gives back as 0.0; record 0.0"
    if isinstance(value, float) and "e+" in repr(value):
        # jsonb keeps a number as numeric, which prints 1e+16 as 10000000000000000: a resume
        # would read an int where the phase returned a float.
        return (
            f"{where} is the float {value!r}, which jsonb gives back as an int; record it as "
            "a str, or as an int if it is whole"
        )
    if isinstance(value, dict):
        for name, item in value.items():
            inner = f"{path}[{name!r}]"
            problem = (
                _unstorable_text(name, f"the key of the value{inner}")
                if isinstance(name, str)
                else None
            ) or _unstorable(item, inner, depth + 1)
            if problem is not None:
                return problem
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            problem = _unstorable(item, f"{path}[{index}]", depth + 1)
            if problem is not None:
                return problem
    return None


def _unstorable_text(text: str, where: str) -> str | None:
    if "\x00" in text:
        return f"{where} holds a NUL character, which jsonb cannot store"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where} holds a lone surrogate, which is not UTF-8 text"
    return None


def failure_note(error: BaseException) -> str:
    """A failure as a lease records it: the type and the first line of the message.

    A message may carry a NUL or a lone surrogate (a provider's bytes echoed back): the note must
    still be storable, or the lease would not end and the work's error would be lost.
    """
    text = str(error).strip().splitlines()
    note = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return storable_text(note[:MAX_FAILURE_NOTE])


def not_stored_note(status: int | None) -> str:
    """What a lease records for an answer that is not stored (a 5xx): tried again."""
    return f"not stored: answered {status}"


@refuse_changes
@dataclass(frozen=True, slots=True)
class Abandoned:
    """A two-phase request whose holder's lease ran out: the completer's work item."""

    scope: str
    key: str
    operation: str
    #: Holders so far: the first claim and each takeover.
    attempts: int


@dataclass(slots=True)
class CompleterPass:
    """What one pass of the completer did."""

    #: Requests finished from their recovery point.
    finished: int = 0
    #: Requests whose work failed again (their lease ends; the next pass tries again).
    failed: int = 0
    #: Requests retired with a stored problem answer.
    retired: int = 0
    #: One line per failure, for the log.
    errors: list[str] = field(default_factory=list)


def retired_response(scope: str, key: str, attempts: int, error: str | None) -> Response:
    """The answer stored for a request the completer gave up on after ``attempts`` holders.

    A problem document (RFC 9457) with status 500, stored like any answer: every retry of the
    key replays it, and nothing runs again.
    """
    body = {
        "type": "https://pgonce.dev/problems/retired",
        "title": "The request was abandoned and could not be finished",
        "status": 500,
        "detail": (
            f"the request failed {attempts} times and was retired; last error: {error or 'unknown'}"
        ),
    }
    return Response(
        500,
        (("content-type", "application/problem+json"),),
        json.dumps(body, separators=(",", ":")).encode(),
    )


def check_retire_after(value: object) -> int:
    """Refuse a number of attempts before retirement below 1."""
    if type(value) is not int or value < 1:
        raise UsageError(f"retire_after is a whole number of attempts of at least 1, not {value!r}")
    return value
