"""The HTTP semantics of Idempotency-Key, written once for every framework adapter.

This module decides; it does no I/O and knows no framework. An adapter (the ASGI middleware,
``pgonce.contrib.django``) translates its framework's request into the calls below, runs the
claim and the endpoint in its framework's transaction, and sends the :class:`Answer` it is given
back in its framework's response type. So the answers are the same whichever adapter serves them:

=====  ==========================================================================================
400    the Idempotency-Key is missing (on a route that requires one), empty, longer than 255
       characters, sent twice or malformed
409    a request with this key is still being processed (after the adapter's bounded ``wait``,
       when one is set: :class:`HolderWait` on two-phase routes); ``Retry-After`` says when to
       retry
413    the request body exceeds ``max_request_bytes`` (checked from ``Content-Length`` before the
       body is read, then on the bytes read)
422    the key was first used with another request (method, path, query or body)
401    the key scope named no caller and the endpoint asked for the claim's transaction
500    the response exceeded ``max_response_bytes``: it cannot be stored, so it is not given out
       and the endpoint's work is rolled back (on a two-phase route, the phases that committed
       are kept, and a retry with the same key resumes after them:
       :data:`RESPONSE_TOO_LARGE_RESUMABLE`); or the endpoint ended the request's transaction
       itself and ran on, or tried to: after a rollback or a refused attempt nothing of it
       committed (:data:`TRANSACTION_ENDED`), after a COMMIT its writes before it committed with
       the claim, which stays in flight (:data:`TRANSACTION_ENDED_COMMITTED`)
503    the database unreachable, timed out or in conflict; nothing committed; ``Retry-After``
=====  ==========================================================================================

A replay answers the stored status, the byte-identical body and the stored headers (never
``Set-Cookie``, hop-by-hop, ``Content-Length`` or ``Date``: :mod:`pgonce.http.replay`), marked
``Idempotent-Replayed: true``. The same answers hold on a route served in two-phase mode
(:meth:`IdempotencyRules.is_two_phase`). Every answer for a stored key carries
``Idempotency-Key-Expires`` (claim time plus ``retention``).

What is stored: the endpoint's complete response, if the endpoint *began* (it took the claim's
transaction; framework validation and authentication that refuse a request before the endpoint
runs are not stored, so the corrected retry runs), the body fits ``max_response_bytes``, the status
is not 429 (a rate limit refused the request: the retry after ``Retry-After`` must run), and the key
store keeps the status (a 5xx is not kept unless the store is configured to). Whatever is not
stored is rolled back together with the endpoint's writes, and the key stays free.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Generic, TypeVar

from psycopg.pq import TransactionStatus

from pgonce.core.checks import describe
from pgonce.core.frozen import refuse_changes
from pgonce.core.outcomes import TOO_MANY_REQUESTS, InFlight, Replay, Response, Won, new_response
from pgonce.core.requests import request_fingerprint
from pgonce.errors import InvalidIdempotencyKey, UsageError
from pgonce.http.keys import key_of, parse_key
from pgonce.http.problem import CONTENT_TYPE, problem_body
from pgonce.http.replay import (
    EXPIRES_HEADER,
    replay_headers,
    storable_pairs,
    storable_text_pairs,
)

#: Response headers as every adapter exchanges them: lower-case names, latin-1 bytes (ASGI's own
#: shape, so that the ASGI middleware sends them untouched).
RawHeaders = list[tuple[bytes, bytes]]

#: The methods that need idempotency unless a route says otherwise. GET, HEAD, OPTIONS, PUT and
#: DELETE are idempotent by definition (RFC 9110); POST and PATCH are not.
DEFAULT_METHODS = frozenset({"POST", "PATCH"})

#: Largest request body read for fingerprinting, in bytes. Payment and order APIs send a few
#: kilobytes; one MiB leaves room without letting one request hold a megabyte buffer per retry.
DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024

#: Largest response body stored for replay, in bytes (the same reasoning as for requests).
DEFAULT_MAX_RESPONSE_BYTES = 1024 * 1024

#: How long a key is advertised as honoured (``Idempotency-Key-Expires``). Stripe keeps keys for
#: 24 hours, and clients' retry policies are built around that figure. The sweeper's horizon must
#: be at least this long, or the header would promise more than the store keeps.
DEFAULT_RETENTION = timedelta(hours=24)

#: What "do not wait" (``wait=None``, every adapter's default) means for the claim's lock wait.
#: Not one millisecond: the claim's INSERT also waits on PostgreSQL's own short locks (a table
#: extended by concurrent inserts), and a timeout there would answer 409 to a brand-new key.
#: 100 ms rides those out and is still far shorter than any endpoint a duplicate waits for.
NO_WAIT = timedelta(milliseconds=100)

#: The first pause of a duplicate that waits for a two-phase holder. The holder's lease is not a
#: lock the duplicate can queue on (the claim committed long ago), so it looks at the key again
#: after a pause: 20 ms sees a short request end without adding much to the duplicate's answer.
FIRST_LOOK = 0.02

#: The longest pause between two looks: the pauses double up to this, so a duplicate that waits
#: two seconds looks some ten times (one short read each), and answers within a quarter second
#: of the holder's commit.
LONGEST_LOOK = 0.25

_EXPIRES = EXPIRES_HEADER.encode()
# Module constants: an enum class's attribute lookup at each request otherwise.
_INERROR = TransactionStatus.INERROR
#: The status of a connection whose transaction the endpoint ended (see ended_by_endpoint()).
IDLE = TransactionStatus.IDLE


@refuse_changes
@dataclass(frozen=True, slots=True)
class Answer:
    """A response an adapter sends as it is: status, headers (:data:`RawHeaders`) and body."""

    status: int
    headers: RawHeaders
    body: bytes


def problem(
    status: int, title: str, detail: str, headers: Sequence[tuple[str, str]] = ()
) -> Answer:
    """An RFC 9457 problem answer (:mod:`pgonce.http.problem`)."""
    body = problem_body(status, title, detail)
    return Answer(
        status,
        [
            (b"content-type", CONTENT_TYPE.encode()),
            (b"content-length", str(len(body)).encode()),
            *((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers),
        ],
        body,
    )


#: The answers that depend on nothing but the request's fate, built once.
MISSING_KEY = problem(
    400, "Idempotency-Key required", "this request must carry an Idempotency-Key header"
)
MISMATCH = problem(
    422,
    "Idempotency-Key reused",
    "this Idempotency-Key was first used with a different request (method, path, query or "
    "body); retry only with the identical request, or use a new key",
)
#: The endpoint asked for the claim of a request whose key scope named no caller (see UNSCOPED).
MISSING_SCOPE = problem(
    401,
    "Authentication required",
    "this request carries an Idempotency-Key but names no caller, so the key cannot be claimed; "
    "send the credentials the key belongs to",
)
#: What an adapter records on a request it passes on without a claim because the key scope
#: returned None: the endpoint's helper then raises MissingKeyScope, which the adapter answers
#: with MISSING_SCOPE (401), not as a failure of its own (500).
UNSCOPED = "pgonce: no key scope"
RESPONSE_TOO_LARGE = problem(
    500,
    "Response too large to store",
    "the response exceeded the size that can be stored for replay; nothing was done",
)
#: The same on a two-phase route whose work ran (or an earlier holder's did): its phases
#: committed their recovery points (a third party may have been called) and the key is kept,
#: so only a retry with the same key is safe. See :func:`response_too_large`.
RESPONSE_TOO_LARGE_RESUMABLE = problem(
    500,
    "Response too large to store",
    "the response exceeded the size that can be stored for replay, after the request's work "
    "had begun: its recorded steps (calls to third parties among them) were kept, and a retry "
    "with the same Idempotency-Key resumes it without doing them again (and is answered this "
    "way again while the response is too large); never send it with a new key, which would "
    "do the work again",
)


def response_too_large(captured: CapturedResponse) -> Answer:
    """The 500 problem for a response over ``max_response_bytes``: that nothing was done, or,
    when its work's recorded steps were kept (:attr:`CapturedResponse.resumable`), that a retry
    with the same key resumes it."""
    return RESPONSE_TOO_LARGE_RESUMABLE if captured.resumable else RESPONSE_TOO_LARGE


#: The endpoint rolled back the request's transaction itself and ran on, or tried to commit or
#: roll it back and was refused: nothing of the request committed, no answer is stored, and the
#: key is free, so a retry runs the request again.
TRANSACTION_ENDED = problem(
    500,
    "Transaction ended by the endpoint",
    "the endpoint rolled back the request's transaction itself, or tried to commit or roll it "
    "back, while it is committed only once its response is stored; nothing of the request "
    "committed and no answer was stored: a retry with this Idempotency-Key runs it again",
)

#: The endpoint committed the request's transaction itself and ran on: its writes before that
#: COMMIT committed with the claim, what it ran after was rolled back, and its answer (which may
#: name rows never made) is neither sent nor stored. The claim stays in flight until the key
#: expires, so that no retry makes those writes again.
TRANSACTION_ENDED_COMMITTED = problem(
    500,
    "Transaction ended by the endpoint",
    "the endpoint committed the request's transaction itself and ran on, while it is committed "
    "only once its response is stored: what it wrote before its COMMIT committed, with this "
    "Idempotency-Key's claim, and what it ran after was rolled back; no answer was stored, so "
    "a retry with this key is answered 409 (in progress) until the key expires, and never "
    "makes those writes again",
)


def log_transaction_ended(scope: str, error: BaseException) -> None:
    """Say that an endpoint committed or rolled back the request's transaction, or tried to (a
    refusal is answered :data:`TRANSACTION_ENDED`): a bug of the endpoint, named by the typed
    error, which says what became of the request. One line, no traceback."""
    _log.error(
        "idempotent request's transaction ended by its endpoint: %s: %s",
        type(error).__name__,
        error,
        extra={"scope": scope, "outcome": "transaction_ended"},
    )


def invalid_key(error: InvalidIdempotencyKey) -> Answer:
    """400 for a malformed key; the message never quotes the header's value."""
    return problem(error.status, error.title, str(error))


def in_flight(claim: InFlight) -> Answer:
    return problem(
        409,
        "Request in progress",
        "a request with this Idempotency-Key is still being processed; "
        "retry after the time in Retry-After",
        headers=[("retry-after", str(claim.retry_after))],
    )


def log_not_stored(claim: Won) -> None:
    """Say that a won claim's completion found no claim: the endpoint ended the request's
    transaction (the claim went with it) and wrote in a new one, which COMMIT then committed
    without the key. Too late to refuse: the work has committed, so its answer goes out (a 5xx
    would ask for the retry that runs it again), without the expiry header of a stored key."""
    _log.error(
        "idempotent request's response not stored: the endpoint rolled back the request's "
        "transaction (the claim with it) and wrote in a new one, which committed without the "
        "key; a retry runs again. Undo a part with a savepoint, or raise to roll back",
        extra={"scope": claim.scope, "outcome": "not_stored"},
    )


def log_unavailable(scope: str, error: BaseException) -> None:
    """Say that a claimed request lost the database (answered :func:`unavailable`): one line, no
    traceback, as an outage is an event to count, not a bug to debug. Its transaction was rolled
    back, or committed just as the connection was lost: either way nothing half-done was kept,
    and the retry runs the request once or replays what committed."""
    text = str(error).strip()
    _log.warning(
        "idempotent request not answered, the database went away (nothing half-done was kept; "
        "the retry runs it once or replays it): %s%s",
        # psycopg's class (AdminShutdown, QueryCanceled...), which a framework's error wraps.
        type(error.__cause__ or error).__name__,
        f": {text.splitlines()[0]}" if text else "",
        extra={"scope": scope, "outcome": "unavailable"},
    )


_log = logging.getLogger("pgonce.http")


def sqlalchemy_unavailable() -> tuple[type[Exception], ...]:
    """SQLAlchemy's "the database went away" errors, where SQLAlchemy is installed: its
    OperationalError, which wraps psycopg's, and its pool's TimeoutError. An endpoint that writes
    through a SQLAlchemy session meets a lost database as these, not as psycopg's: every adapter
    answers them as it answers psycopg's (503 with ``Retry-After``)."""
    try:
        from sqlalchemy import exc
    except ImportError:
        return ()
    return (exc.OperationalError, exc.TimeoutError)


def went_away_in_sqlalchemy(error: BaseException) -> bool:
    """Whether ``error`` is one of :func:`sqlalchemy_unavailable`'s, looked at only when it is
    SQLAlchemy's (then SQLAlchemy is loaded): an application without it never imports it."""
    return type(error).__module__.startswith("sqlalchemy.") and isinstance(
        error, sqlalchemy_unavailable()
    )


def unavailable(retry_after: int) -> Answer:
    return problem(
        503,
        "Service temporarily unavailable",
        # Not "nothing was committed": a connection lost during COMMIT leaves that unknown. The
        # retry with the same key settles it: it runs the request once, or replays what committed.
        "the database could not be reached, timed out or refused a conflicting transaction, and "
        "nothing half-done was kept; retry with the same Idempotency-Key",
        headers=[("retry-after", str(retry_after))],
    )


class HolderWait:
    """A duplicate's bounded wait for the holder of a two-phase key: when to look again.

    On a one-transaction route the duplicate's claim waits on the original's row lock, up to the
    adapter's ``wait``, and then replays (or runs, if the original rolled back). On a two-phase
    route the claim committed at once, so there is no lock to wait on: the adapter looks at the
    key again (``start()``) after each :meth:`pause` until it is no longer in flight or the wait
    is over, and then answers as usual: the stored answer replayed, the endpoint run (the holder
    failed and the key is taken over), or 409. ``clock`` is a monotonic clock in seconds, read
    from the moment the wait begins; a look that meets a phase's open transaction may wait for
    it up to the store's own ``wait`` on top of the last pause. ``wait=None`` waits not at all:
    the duplicate is answered 409 at once.
    """

    __slots__ = ("_clock", "_deadline", "_next")

    def __init__(self, wait: timedelta | None, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._deadline = clock() + (wait.total_seconds() if wait is not None else 0.0)
        self._next = FIRST_LOOK

    def pause(self) -> float | None:
        """Seconds to pause before the next look; ``None`` once the wait is over."""
        left = self._deadline - self._clock()
        if left <= 0:
            return None
        pause = min(self._next, left)
        self._next = min(self._next * 2, LONGEST_LOOK)
        return pause


@functools.lru_cache(maxsize=16)
def _http_date(epoch_seconds: int) -> str:
    # An HTTP-date has whole seconds, so every request of one second shares the formatted value.
    return format_datetime(datetime.fromtimestamp(epoch_seconds, UTC), usegmt=True)


Op = TypeVar("Op")


class PhasedRequest(Generic[Op]):
    """A two-phase request's operation, as an adapter hands it to the endpoint.

    Taking :attr:`operation` marks the endpoint as begun: only then is its response stored (as
    taking the claim's transaction does on a one-transaction route).
    """

    __slots__ = ("_operation", "began")

    def __init__(self, operation: Op) -> None:
        self._operation = operation
        self.began = False

    @property
    def operation(self) -> Op:
        self.began = True
        return self._operation


class CapturedResponse:
    """The endpoint's response, held back until its transaction has committed.

    An adapter feeds it the status, headers and body chunks as its framework produces them; a
    body over the limit is dropped as soon as it is seen (only its size is kept).
    """

    # Not a dataclass: the defaults below are class attributes that a response overrides only
    # where it differs, so that a capture per request sets three attributes, not thirteen (the
    # generated __init__ with its default factories cost 44 bytecodes of every request).
    status: int | None = None
    #: The headers as text instead (WSGI and Django hand them over as latin-1 ``str``): when
    #: set, they are what is stored, and :attr:`headers` is not used.
    text_headers: Sequence[tuple[str, str]] | None = None
    size: int = 0
    complete: bool = False
    too_large: bool = False
    #: Decided after the endpoint returned: the response is kept for replays.
    stored: bool = False
    #: The database went away while the endpoint ran or while its work was committed: nothing
    #: committed (or, if COMMIT's answer was lost, the retry replays what did), so the client is
    #: told to retry: 503 with Retry-After, never a 500 and a traceback.
    unavailable: bool = False
    #: The endpoint ended the request's transaction itself and its answer is not given: the
    #: client is told what became of the request instead (:attr:`ended_answer`; see
    #: :meth:`ended_by_endpoint` and :meth:`ended_then_wrote`).
    ended: bool = False
    #: With :attr:`ended`: the endpoint had committed the claim with its writes before the end
    #: (:data:`TRANSACTION_ENDED_COMMITTED`), not rolled it back (:data:`TRANSACTION_ENDED`).
    ended_committed: bool = False
    #: A two-phase request not stored whose work's recorded steps were kept for the retry with
    #: the same key (its lease ended, not released): what a 500 problem must say instead of
    #: "nothing was done" (see :func:`response_too_large`).
    resumable: bool = False

    def __init__(self, limit: int) -> None:
        #: Largest body kept, in bytes (``max_response_bytes``).
        self.limit = limit
        self.headers: RawHeaders = []
        self.body: list[bytes] = []

    def add(self, chunk: bytes, more: bool) -> None:
        """One chunk of the body; ``more`` is false for the last one."""
        if self.complete:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            self.too_large = True
            self.body.clear()
        elif chunk:
            self.body.append(chunk)
        self.complete = not more

    @property
    def answered(self) -> bool:
        """A complete response, within the size limit, that can be sent (and stored)."""
        return self.status is not None and self.complete and not self.too_large

    def keep(self, *, began: bool, status_kept: Callable[[int | None], bool]) -> bool:
        """Decide (and remember) whether the response is stored for replays.

        Stored only when the endpoint began (framework validation and authentication failures
        never do), answered completely within the size limit, the status is not 429, and the key
        store keeps the status (``status_kept``: the store's ``stores_status``; a 5xx is not
        kept unless configured). A 429 (a throttle that refused the request, even one that read
        the database first) is never kept: the work was refused, not done, and the retry after
        ``Retry-After`` must run it rather than replay the refusal.
        """
        status = self.status
        self.stored = stored = (
            began
            and status is not None  # self.answered, without the property's call
            and self.complete
            and not self.too_large
            and status != TOO_MANY_REQUESTS
            and status_kept(status)
        )
        return stored

    def commits(self, transaction_status: int) -> bool:
        """Whether the request's transaction commits with this answer stored (after
        :meth:`keep`); otherwise it is rolled back and the answer goes out, not stored.

        A transaction in which a statement failed cannot commit: the endpoint answered after it
        (an error handler's 409 for a unique violation), so nothing of it is kept.
        """
        if transaction_status == _INERROR:
            self.stored = False
        return self.stored

    def claim_lost(self, claim: Won) -> None:
        """The completion, sent with COMMIT, found no claim to complete: the endpoint ended the
        request's transaction itself (see :func:`log_not_stored`). Nothing is stored."""
        self.stored = False
        log_not_stored(claim)

    def ended_by_endpoint(self, claim: Won, *, found: bool | None) -> None:
        """The endpoint committed or rolled back the request's transaction on its connection
        and ran nothing since (the connection was idle when it returned), and the adapter then
        settled the claim in a transaction of its own: completed it with the response if the
        response is kept (:meth:`keep`), else released it. ``found``: whether that completion
        found the claim (``None``: released, not known).

        Found, the endpoint had committed the claim with its writes before the response was
        stored: the response is stored now, so the key is not left in flight, and its answer
        goes out. Not found, it had rolled the claim back, and nothing of the request committed:
        the client is told so (:data:`TRANSACTION_ENDED`) and the retry runs. Either way the
        log names the error."""
        self.stored = bool(found)
        self.ended = found is False
        if found:
            outcome = (
                "it committed the claim with its writes before the response was stored (had the "
                "process stopped there, the key would have stayed in flight until it expired); "
                "the response was stored after it"
            )
        elif found is None:
            outcome = "its answer was not stored, and the key was freed"
        else:
            outcome = "it rolled back the claim with its writes: nothing was done"
        log_transaction_ended(
            claim.scope,
            UsageError(
                "the endpoint committed or rolled back the request's transaction on its "
                f"connection itself: {outcome}. Let the middleware commit once the response is "
                "stored: undo a part with a savepoint, or raise to undo it all"
            ),
        )

    def ended_then_wrote(self, claim: Won, error: BaseException, *, committed: bool) -> None:
        """The endpoint ended the request's transaction and ran on in the one psycopg opened
        next, and the key store's commit found the end (``error``) and rolled back what ran
        after it. The answer was made after those statements, which are gone (a 201 may name a
        row never made): it is neither sent nor stored. The claim stays as the end left it:
        rolled back, the key free (``committed`` false), or committed with the writes before
        the end (``committed`` true), in flight until it expires so that no retry makes those
        again. The log names the error."""
        self.stored = False
        self.ended = True
        self.ended_committed = committed
        # The error's own text names both outcomes (the key store cannot tell which); the log
        # names the one that happened.
        outcome = (
            "a COMMIT had committed the claim with the writes before it: the key stays in flight "
            "until it expires, so that no retry makes those writes again"
            if committed
            else "a rollback had taken the claim with the writes before it: the key is free, and "
            "a retry runs the work again, whole"
        )
        log_transaction_ended(
            claim.scope,
            type(error)(
                "the endpoint ended the request's transaction and ran statements after that end, "
                "in a new transaction: they were rolled back, and the answer made after them was "
                f"neither sent nor stored; {outcome}. Let the middleware commit once the response "
                "is stored: undo a part with a savepoint, or raise to undo it all"
            ),
        )

    @property
    def ended_answer(self) -> Answer:
        """The answer to a request whose endpoint ended its transaction (:attr:`ended`)."""
        return TRANSACTION_ENDED_COMMITTED if self.ended_committed else TRANSACTION_ENDED

    def response(self) -> Response:
        """What the key store keeps for replays."""
        # The headers filtered and checked in one walk of them, not three (the filter, then
        # Response's checks, then its tuple again).
        text = self.text_headers
        pairs = storable_pairs(self.headers) if text is None else storable_text_pairs(text)
        return new_response(self.status, pairs, b"".join(self.body))


#: The longest ``retention``: the Idempotency-Key-Expires date stays a date HTTP can carry.
MAX_RETENTION = timedelta(days=36525)

#: An HTTP method is a token (RFC 9110, section 9.1).
METHOD = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class IdempotencyRules:
    """Which requests need a key, what makes two requests the same, and every answer.

    ``routes`` maps path prefixes to the methods that need idempotency there (the longest prefix
    on a segment boundary wins; an empty collection turns a route off); other paths use
    ``methods``. ``require_key`` answers 400 to such a request without a key (else it passes,
    unprotected).
    """

    __slots__ = (
        "_retention_seconds",
        "canonicalize_json",
        "max_request_bytes",
        "max_response_bytes",
        "methods",
        "request_too_large",
        "require_key",
        "retention",
        "routes",
        "two_phase",
    )

    def __init__(
        self,
        *,
        methods: Collection[str] = DEFAULT_METHODS,
        routes: Mapping[str, Collection[str]] | None = None,
        require_key: bool = True,
        canonicalize_json: bool = True,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        retention: timedelta = DEFAULT_RETENTION,
        two_phase: Collection[str] = (),
    ) -> None:
        # Refused here, naming the option, as every request would trip over it (a 500, or a
        # route silently unprotected): the same under every adapter.
        if routes is not None and not isinstance(routes, Mapping):
            raise UsageError(
                f"routes must map path prefixes to collections of methods, not {describe(routes)}"
            )
        # One name where a collection of them is meant would be split into its letters, and
        # leave every route unprotected (or make every path two-phase) without a word.
        for what, value in (
            ("methods", methods),
            ("two_phase", two_phase),
            *((f"routes[{prefix!r}]", ms) for prefix, ms in (routes or {}).items()),
        ):
            if isinstance(value, str | bytes):
                raise UsageError(
                    f"{what} must be a collection of names, not the str {value!r}: "
                    f"write [{value!r}]"
                )
            if not isinstance(value, Collection):
                raise UsageError(f"{what} must be a collection of names, not {describe(value)}")
            if what != "two_phase":
                for method in value:
                    if not isinstance(method, str) or not METHOD.fullmatch(method):
                        raise UsageError(
                            f"{what} must hold HTTP method names such as 'POST', not {method!r}"
                        )
        # A request's path starts with "/": any other prefix would never match ("" matches all).
        for what, prefixes in (("routes", routes or ()), ("two_phase", two_phase)):
            for prefix in prefixes:
                if not isinstance(prefix, str) or (prefix and not prefix.startswith("/")):
                    raise UsageError(
                        f"{what} prefix {prefix!r} must be a path starting with '/', which no "
                        "request's path would otherwise match"
                    )
        for what, flag in (("require_key", require_key), ("canonicalize_json", canonicalize_json)):
            if not isinstance(flag, bool):
                raise UsageError(f"{what} must be True or False, not {describe(flag)}")
        for what, size in (
            ("max_request_bytes", max_request_bytes),
            ("max_response_bytes", max_response_bytes),
        ):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UsageError(f"{what} must be a positive number of bytes, not {size!r}")
        if not isinstance(retention, timedelta):
            raise UsageError(f"retention must be a datetime.timedelta, not {describe(retention)}")
        if not timedelta(0) <= retention <= MAX_RETENTION:
            # Idempotency-Key-Expires is an HTTP date: one past year 9999 cannot be written, which
            # every answer would find after its transaction committed.
            raise UsageError(f"retention must be between 0 and 100 years, not {retention}")
        self.methods = frozenset(m.upper() for m in methods)
        #: Path prefixes served in two-phase mode (the endpoint calls a third party and answers
        #: with its result: pgonce.phases), longest first; every other path: one transaction.
        self.two_phase = sorted((p.rstrip("/") for p in two_phase), key=len, reverse=True)
        # Longest prefix first, so that the most specific route decides.
        self.routes = sorted(
            (
                (prefix.rstrip("/"), frozenset(m.upper() for m in ms))
                for prefix, ms in (routes or {}).items()
            ),
            key=lambda item: len(item[0]),
            reverse=True,
        )
        self.require_key = require_key
        self.canonicalize_json = canonicalize_json
        self.max_request_bytes = max_request_bytes
        self.max_response_bytes = max_response_bytes
        self.retention = retention
        self._retention_seconds = retention.total_seconds()
        #: 413: the answer to a request body over ``max_request_bytes``.
        self.request_too_large = problem(
            413,
            "Request body too large",
            f"idempotent requests may carry at most {max_request_bytes} bytes",
        )

    def methods_for(self, path: str) -> frozenset[str]:
        """The methods that need idempotency on ``path``."""
        if not self.routes:
            return self.methods
        for prefix, methods in self.routes:
            if path == prefix or path.startswith(prefix + "/") or not prefix:
                return methods
        return self.methods

    def route_methods(self, path: str) -> frozenset[str] | None:
        """The methods of the ``routes`` entry that matches ``path``; ``None`` when none does
        (then :meth:`methods_for` is ``methods``)."""
        for prefix, methods in self.routes:
            if path == prefix or path.startswith(prefix + "/") or not prefix:
                return methods
        return None

    def is_two_phase(self, path: str) -> bool:
        """Whether ``path`` is served in two-phase mode (a prefix of ``two_phase`` matches).

        Its answers are those of the one-transaction mode: a replay is the stored response byte
        for byte, a duplicate while the holder's lease runs is in flight (409; with a ``wait``,
        after waiting that long for the holder's answer: :class:`HolderWait`), a mismatch 422.
        What differs is what is stored: the claim commits before the endpoint runs, each phase
        commits on its own, and a response that is not stored hands the key on from its
        recovery point instead of freeing it.
        """
        return any(
            path == prefix or path.startswith(prefix + "/") or not prefix
            for prefix in self.two_phase
        )

    def applies(self, method: str, path: str) -> bool:
        """Whether a ``method`` request to ``path`` is handled (needs a key, or may carry one)."""
        return method in self.methods_for(path)

    @staticmethod
    def key(values: Sequence[bytes]) -> str | None:
        """The key of the request's Idempotency-Key field values; ``None`` without one.

        Raises :class:`~pgonce.errors.InvalidIdempotencyKey` (answer :func:`invalid_key`).
        """
        return key_of(values)

    @staticmethod
    def joined_key(value: str | None) -> str | None:
        """:meth:`key` of the one text value a WSGI server (or Django) gives for the field, its
        repeated values already joined with a comma; ``None`` without the header."""
        return None if value is None else parse_key(value)

    def declared_too_large(self, content_length: bytes | str | None) -> bool:
        """Whether a declared Content-Length already exceeds ``max_request_bytes``."""
        return bool(
            content_length
            and content_length.isascii()  # "²".isdigit(), and int() refuses it
            and content_length.isdigit()
            and int(content_length) > self.max_request_bytes
        )

    def fingerprint(
        self, method: str, path: str, query: bytes, body: bytes, content_type: str | None
    ) -> bytes:
        """What the key is bound to: method, path, query string and (canonical JSON) body."""
        return request_fingerprint(
            method,
            path,
            query,
            body,
            content_type=content_type,
            canonicalize_json=self.canonicalize_json,
        )

    def capture(self) -> CapturedResponse:
        """An empty capture of an endpoint's response, bounded by ``max_response_bytes``."""
        return CapturedResponse(self.max_response_bytes)

    def expires(self, claimed_at: datetime) -> str:
        """The ``Idempotency-Key-Expires`` HTTP-date of a key claimed at ``claimed_at``."""
        return _http_date(int(claimed_at.timestamp() + self._retention_seconds))

    def expires_header(self, claimed_at: datetime) -> tuple[bytes, bytes]:
        return (_EXPIRES, self.expires(claimed_at).encode())

    def expires_text_header(self, claimed_at: datetime) -> tuple[str, str]:
        """:meth:`expires_header` as text, for WSGI and Django responses."""
        return (EXPIRES_HEADER, self.expires(claimed_at))

    def replay(self, claim: Replay) -> Answer:
        """The stored response again, marked ``Idempotent-Replayed``, with its expiry."""
        response = claim.response
        expires = (EXPIRES_HEADER, self.expires(claim.claimed_at))
        return Answer(response.status or 200, replay_headers(response, [expires]), response.body)
