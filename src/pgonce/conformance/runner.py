"""Running a suite of checks in order, within one time budget.

Checks run one after the other (the effect count is read around each, so two checks must never
overlap). Each gets a share of what is left of the budget (what is left divided by the checks
left, never less than one request's timeout): a check still waiting when its share runs out fails
with that said, after the faults it had already found, and the ones after it still run; once the
budget itself runs out, the ones after it are not started. A check that cannot reach the server
fails with the transport error; a broken count contract stops the run with a usage error.

A 429 Too Many Requests is a request the server did not execute: the kit sends it again after its
Retry-After when that fits in the check's time (:func:`patiently`), and says so when it does not:
the check is then not decided, unless it had already found a fault, which it fails on.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Generic, Literal, TypeVar

from pgonce.conformance.report import Check, Finding, Report, Result, gathering
from pgonce.core.urls import public
from pgonce.errors import UsageError
from pgonce.extras import needs

with needs("http", "pgonce conformance"):
    import httpx

#: The default time budget of a whole run, in seconds: the kit belongs in CI, next to unit tests.
DEFAULT_BUDGET = 55.0

#: How long one request may take, in seconds. A server that needs longer to answer one request is
#: not one an idempotency check can judge.
REQUEST_TIMEOUT = 10.0

#: The most the kit reads of one answer's body, in bytes (after any Content-Encoding is undone).
#: httpx's read timeout starts again at every byte, so a server streaming an endless (or huge)
#: body fast would be read into memory until the run's budget ran out; 4 MiB is far above any
#: API answer or webhook acknowledgement, and bounds a burst of concurrent answers too.
MAX_ANSWER_BYTES = 4 * 1024 * 1024

#: The least share of the budget a check gets while that much is left, in seconds: never below
#: one request's timeout, which says better what went wrong than a share running out.
CHECK_FLOOR = REQUEST_TIMEOUT + 1

#: How many times one request answered 429 Too Many Requests is sent again after its Retry-After.
RATE_LIMIT_RETRIES = 3

#: The longest Retry-After the kit waits for, in seconds (and never beyond the check's time).
MAX_RETRY_AFTER = 5.0

#: When the check under way must have its verdict (monotonic seconds; None outside a check).
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "conformance_deadline", default=None
)

Context = TypeVar("Context")
T = TypeVar("T")
CheckBody = Callable[[Context], Awaitable[Finding]]


class Suite(Generic[Context]):
    """The checks of one kind, registered in the order they run with :meth:`check`."""

    def __init__(self, kind: Literal["http", "webhooks"], *, floor: float = CHECK_FLOOR) -> None:
        self.kind: Literal["http", "webhooks"] = kind
        #: The least share of the budget one check gets (while that much is left).
        self.floor = floor
        self.checks: list[tuple[Check, CheckBody[Context]]] = []

    def check(
        self, name: str, why: str, source: str
    ) -> Callable[[CheckBody[Context]], CheckBody[Context]]:
        def register(body: CheckBody[Context]) -> CheckBody[Context]:
            if any(known.name == name for known, _ in self.checks):
                raise ValueError(f"two checks are named {name}")
            self.checks.append((Check(name, why, source), body))
            return body

        return register

    def catalogue(self) -> list[Check]:
        return [check for check, _ in self.checks]

    def selected(self, only: Sequence[str] = ()) -> list[tuple[Check, CheckBody[Context]]]:
        if not only:
            return list(self.checks)
        known = {check.name for check, _ in self.checks}
        unknown = sorted(set(only) - known)
        if unknown:
            raise UsageError(
                f"no {self.kind} check named {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return [(check, body) for check, body in self.checks if check.name in only]

    async def run(
        self, context: Context, target: str, *, budget: float, only: Sequence[str] = ()
    ) -> Report:
        started = time.monotonic()
        deadline = started + budget
        results: list[Result] = []
        selected = self.selected(only)
        for index, (check, body) in enumerate(selected):
            left = deadline - time.monotonic()
            if left <= 0:
                results.append(Result(check, "FAIL", "not run: the time budget ran out"))
                continue
            # A fair share, so that one check that waits long fails alone: the time left divided
            # by the checks left, never less than the floor (nor more than what is left).
            share = min(left, max(left / (len(selected) - index), self.floor))
            token = _deadline.set(time.monotonic() + share)
            try:
                with gathering() as made:
                    finding = await asyncio.wait_for(body(context), timeout=share)
            except TimeoutError:
                finding = cut_short(made, out_of_time(share, left, len(selected) - index - 1))
            except RateLimited as error:
                finding = stopped(made, error)
            except AnswerTooLarge as error:
                finding = cut_short(made, str(error))
            except httpx.HTTPError as error:
                finding = cut_short(
                    made, f"no complete answer to {request_of(error)}: {failure(error)}"
                )
            finally:
                _deadline.reset(token)
            results.append(finding.result(check))
        return Report(self.kind, public(target), tuple(results), time.monotonic() - started)


def out_of_time(share: float, left: float, after: int) -> str:
    """Which limit a check ran out of: its share of the budget, or the budget itself."""
    if share >= left:
        return f"no verdict within the {left:.1f} s left of the run's time budget (--budget)"
    return (
        f"no verdict within its {share:.1f} s share of the run's time budget (--budget), "
        f"{left:.1f} s being left for it and the {after} check{'s' if after != 1 else ''} after it"
    )


def cut_short(made: list[Finding], why: str) -> Finding:
    """The result of a check cut short (``why``: it ran out of time, as :func:`out_of_time` says,
    or a request got no complete answer, or one too large): it fails, on the faults a finding it
    made had already found, when it had, then on ``why``: the evidence keeps why it fails, not
    only where it stopped."""
    faults = [fault for finding in made for fault in finding.faults]
    if not faults:
        return Finding(faults=[why])
    seen = [text for finding in made for text in finding.seen]
    return Finding(seen=seen, faults=[*faults, f"then {why}: the rest of the check was not judged"])


class RateLimited(Exception):
    """A check could not get the answers it needs: the server kept answering 429 Too Many
    Requests to ``what`` (``response`` the last answer, after ``tries`` waits for its
    Retry-After). No verdict from that: a 429 says the request was not executed, nothing about
    the rest; but a check that had already found a fault fails on it (:func:`stopped`)."""

    def __init__(self, what: str, response: httpx.Response, tries: int) -> None:
        self.what = what
        self.tries = tries
        self.retry_after = response.headers.get("retry-after", "").strip()
        super().__init__(
            f"not decided: {self.how()}; a 429 is not executed and says nothing of "
            "idempotency: run the kit where the endpoint is not rate limited"
        )

    def how(self) -> str:
        """``what`` and how it stayed rate limited, for the evidence."""
        return f"{self.what} was rate limited (429 Too Many Requests) {kept_limiting(self)}"


def stopped(made: list[Finding], error: RateLimited) -> Finding:
    """The result of a check the server's rate limiting stopped: not decided, unless a finding
    it made had already found a fault. Then it fails on that fault, the rate limiting said with
    it: a server never escapes a failure by rate limiting what comes after."""
    faults = [fault for finding in made for fault in finding.faults]
    seen = [text for finding in made for text in finding.seen]
    if not faults:
        return Finding().skip(str(error))
    return Finding(
        seen=seen,
        faults=[*faults, f"then {error.how()}: the rest of the check was not judged"],
    )


def kept_limiting(error: RateLimited) -> str:
    """How a request stayed rate limited: after waits, or with a Retry-After too long, or none."""
    if error.tries:
        return f"after {error.tries} wait{'s' if error.tries != 1 else ''} for its Retry-After"
    if error.retry_after:
        return (
            f"with a Retry-After of {error.retry_after!r}, more than the kit waits within the "
            "check's time"
        )
    return "without a Retry-After"


def retry_after(response: httpx.Response) -> float | None:
    """The seconds a 429's Retry-After asks for (delay-seconds or an HTTP-date), None without
    one or when it cannot be read (RFC 9110 §10.2.3)."""
    value = response.headers.get("retry-after", "").strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def pause(response: httpx.Response) -> float | None:
    """How long to wait before sending again what ``response`` answered 429, or None when its
    Retry-After is missing, too long (:data:`MAX_RETRY_AFTER`) or beyond the check's time."""
    wait = retry_after(response)
    if wait is None or wait > MAX_RETRY_AFTER:
        return None
    deadline = _deadline.get()
    # Room for the request sent again, and the count read after it.
    if deadline is not None and time.monotonic() + wait + 1.0 > deadline:
        return None
    return wait


async def patiently(
    send: Callable[[], Awaitable[httpx.Response]], what: str = "a request"
) -> httpx.Response:
    """``send()``'s answer, sent again after its Retry-After while it is a 429 (at most
    :data:`RATE_LIMIT_RETRIES` times, within the check's time). A 429 that stays is raised as
    :class:`RateLimited` when a Retry-After was given: the check is then not decided. One
    without a Retry-After is returned as it is, for the check to judge."""
    response = await send()
    tries = 0
    while response.status_code == 429:
        wait = pause(response)
        if wait is None or tries == RATE_LIMIT_RETRIES:
            if tries or response.headers.get("retry-after"):
                raise RateLimited(what, response, tries)
            return response
        await asyncio.sleep(wait)
        tries += 1
        response = await send()
    return response


async def within(step: Coroutine[Any, Any, T], seconds: float, what: str) -> T:
    """A step before the checks (the first request, the first count read) within ``seconds``: a
    server that trickles its answer resets httpx's timeouts at every byte and would hold the run
    past its budget. The bound is never below the client's and the count's own timeouts, which
    say better what went wrong. ``what`` names the step in the usage error."""
    seconds = max(seconds, REQUEST_TIMEOUT + 1)
    token = _deadline.set(time.monotonic() + seconds)
    try:
        return await asyncio.wait_for(step, timeout=seconds)
    except TimeoutError:
        raise UsageError(f"{what}: no complete answer within {seconds:.1f} s") from None
    finally:
        _deadline.reset(token)


def client(**options: Any) -> httpx.AsyncClient:
    """The kit's HTTP client: no redirects followed (a check judges the server's own answer),
    bounded timeouts, room for a burst of concurrent requests, no cookies kept between requests."""
    return httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT,
        follow_redirects=False,
        limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
        cookies=None,
        **options,
    )


class AnswerTooLarge(httpx.HTTPError):
    """A body longer than :data:`MAX_ANSWER_BYTES`: the kit stopped reading it."""

    def __init__(self, request: httpx.Request) -> None:
        super().__init__(
            f"{request.method} {public(str(request.url))} answered more than "
            f"{MAX_ANSWER_BYTES} bytes; the kit reads at most {MAX_ANSWER_BYTES}"
        )
        self.request = request


async def request(
    session: httpx.AsyncClient, method: str, url: str, **options: Any
) -> httpx.Response:
    """One request, sent again once if a kept-alive connection was closed under it, its body
    read up to :data:`MAX_ANSWER_BYTES` (:class:`AnswerTooLarge` beyond).

    A server may close its connection after an error answer while the pool is about to reuse it;
    the request then never reached it. Sending it once more is what any client (and provider)
    does, and the checks' requests are safe to repeat: each carries its key or its event id.
    """
    try:
        return await _bounded(session, session.build_request(method, url, **options))
    except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
        return await _bounded(session, session.build_request(method, url, **options))


async def _bounded(session: httpx.AsyncClient, sent: httpx.Request) -> httpx.Response:
    """The answer to ``sent``, its body streamed and read whole unless it exceeds the cap."""
    response = await session.send(sent, stream=True)
    body = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_ANSWER_BYTES:
                raise AnswerTooLarge(sent)
    finally:
        await response.aclose()
    # What Response.aread() keeps: .content, .text and .json() read it from here.
    response._content = bytes(body)
    return response


def failure(error: httpx.HTTPError) -> str:
    """Why a request got no answer, in words: httpx's timeouts have no message of their own, nor
    has a connection the server closed unanswered (the end of stream of the TLS handshake, on a
    port that does not serve TLS)."""
    said = str(error)
    if not said and isinstance(error, httpx.TimeoutException):
        said = f"no answer within {REQUEST_TIMEOUT:.0f} s"
    elif not said and isinstance(error, httpx.ConnectError) and _scheme(error) == "https":
        said = (
            "the server closed the connection during the TLS handshake: does it serve TLS on "
            "that port? (http:// if not)"
        )
    elif not said and isinstance(error, httpx.NetworkError):
        said = "the server closed the connection without answering"
    return f"{type(error).__name__}: {said}" if said else type(error).__name__


def _scheme(error: httpx.HTTPError) -> str:
    """The scheme of the URL the failed request was for ("" when the error has no request)."""
    try:
        return str(error.request.url.scheme)
    except RuntimeError:
        return ""


#: What a client sees when the server closes the connection instead of answering: allowed for a
#: body too large (RFC 9110 §15.5.14: "the server MAY close the connection"), where a server
#: that stops reading (Go's, a proxy's) resets the connection under its own 413.
CLOSED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def closed_on(what: str, error: httpx.HTTPError) -> str:
    """The evidence for a body too large that the server closed the connection on."""
    return (
        f"{what}: the server closed the connection instead of reading it all "
        f"({failure(error)}), which RFC 9110 §15.5.14 allows"
    )


def server_failed(response: httpx.Response) -> bool:
    """Whether the server failed to answer: a 5xx is an error of the server (a crash, an outage,
    a proxy whose upstream is down), never a refusal of what was sent."""
    return response.status_code >= 500


def answered(what: str, response: httpx.Response, expected: str | None = None) -> str:
    """A check's fault for an answer it did not expect: ``what`` answered the status, said to be
    a server failure when it is a 5xx, and ``expected`` (such as "401", "a 4xx") when given."""
    said = f"{what} answered {response.status_code}"
    if server_failed(response):
        said += ", a server failure"
    elif response.status_code == 429:
        said += ", rate limited (Too Many Requests)"
    elif redirect := redirected(response):
        said += f", {redirect}"
    return f"{said}, not {expected}" if expected else said


def redirected(response: httpx.Response) -> str | None:
    """``a redirect to URL (not followed)`` for a 3xx with a Location, else None: the kit judges
    the server's own answer, so a redirect (http to https, a moved path) is said with where it
    points, the URL shown as every URL is (:func:`pgonce.core.urls.public`)."""
    location = response.headers.get("location")
    if not response.is_redirect or location is None:
        return None
    return f"a redirect to {public(location)} (not followed)"


def no_answer(error: httpx.HTTPError, url: str) -> str:
    """Why the request to ``url`` before the checks got no answer, for the usage error: the
    server could not be reached, or it was and broke off its answer (closed the connection
    mid-body, sent something that is not HTTP)."""
    if isinstance(error, AnswerTooLarge):
        return str(error)
    if isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError)):
        return f"{public(url)} gave no complete answer: {failure(error)}"
    return f"cannot reach {public(url)}: {failure(error)}"


def request_of(error: httpx.HTTPError) -> str:
    """The request that failed, as ``POST URL`` ("a request" when the error has none)."""
    try:
        return f"{error.request.method} {public(str(error.request.url))}"
    except RuntimeError:
        return "a request"


def shown(response: httpx.Response) -> str:
    """A response as evidence: status, media type and body digest."""
    from pgonce.conformance.report import digest

    media = response.headers.get("content-type", "no content-type").split(";")[0]
    return f"{response.status_code} {media} {digest(response.content)}"


def statuses(answers: list[httpx.Response]) -> str:
    """How many of ``answers`` had each status, as evidence: ``2× 201, 48× 409``."""
    counted: dict[int, int] = {}
    for answer in answers:
        counted[answer.status_code] = counted.get(answer.status_code, 0) + 1
    return ", ".join(f"{n}× {status}" for status, n in sorted(counted.items()))


def reached(answers: list[httpx.Response]) -> list[httpx.Response]:
    """The answers of the copies that reached the endpoint: a 429 Too Many Requests is a copy
    the server's rate limiting refused, not executed (RFC 6585 §4)."""
    return [a for a in answers if a.status_code != 429]


def is_problem(response: httpx.Response) -> bool:
    """Whether the response is an RFC 9457 problem document (``application/problem+json``)."""
    media = str(response.headers.get("content-type", "")).split(";")[0].strip().lower()
    return media == "application/problem+json"
