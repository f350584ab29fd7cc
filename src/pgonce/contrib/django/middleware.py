"""The Idempotency-Key middleware for Django, on Django's own connection and transaction.

For a covered request (POST and PATCH by default) the middleware opens ``transaction.atomic()`` on
``PGONCE["DATABASE"]``, claims ``(scope, key)`` in it with :meth:`KeyStore.claim` and runs the view
inside the same transaction. The view writes with the ORM as usual; its writes, the claim and the
stored response commit together when the atomic block ends, and a view that raises or answers a 5xx
rolls all of it back, so the key is free for the retry. With ``ATOMIC_REQUESTS`` the view's own
atomic block is a savepoint inside the middleware's (Django wraps the view, and the middleware
wraps everything the view is wrapped in), which changes nothing above.

Every decision and every answer (400, 409, 413, 422, replays, expiry) comes from
:mod:`pgonce.http.semantics`, shared with the ASGI middleware; this module only translates Django's
request and response. Under Django's WSGI handler everything runs in the request's thread. Under its
ASGI handler the middleware is async: the checks that need no database run on the event loop, the
transaction runs in one ``sync_to_async`` thread, and an async view's ORM calls
(``sync_to_async``, ``acreate()``...) come back to that thread, so they are on the same connection
and inside the same transaction.

The endpoint *began*, and its answer is stored, once the view ran a query on the connection (or
called :func:`begin`, or took the psycopg connection with
:func:`~pgonce.contrib.django.connection.psycopg_connection`, as ``enqueue()`` does); the savepoints
of Django's own ``atomic()`` blocks (``ATOMIC_REQUESTS`` opens one around every view) are not
queries of the view. A ``transaction.on_commit()`` hook the view registered counts as one: it runs
once, with the stored answer, never dropped with an answer that was not kept. A success (a status
under 400) counts as begun too. A view that refuses a request (400 or more) before touching the
database answers normally and its answer is not kept: the corrected retry runs. A streamed body is
produced inside the transaction, so its queries count as the view's and its writes commit with the
stored response.

A view that raises is never stored, whatever answer Django makes of the exception (404 for
``Http404``, 403, 400, 500): :meth:`IdempotencyMiddleware.process_exception` notes it, and its
writes roll back with the claim. A view that lost the database (Django's ``OperationalError`` or
``InterfaceError``) is answered 503 with Retry-After, as when the middleware's own calls lose
it. Django REST Framework turns exceptions into responses inside the view: those are answers the
view returned, stored once it began (under ``ATOMIC_REQUESTS`` DRF marks the view's transaction for
rollback, below).

A view whose transaction is marked for rollback (``transaction.set_rollback(True)``) while it
answers is not stored either: its writes never commit, so neither does its answer, and the key
stays free. Its transaction is ``ATOMIC_REQUESTS``' block, the view's own outermost ``atomic()``
block, or, outside any, the middleware's; a part it undoes inside it (a nested block, a block an
exception it caught rolled back) is not, nor is its outermost block when it also ran statements
outside that block (before it, in an earlier block, or after it), which without the middleware
would have committed on their own: they commit with the stored answer. A view that tries to end
the request's transaction (``connection.commit()``, which Django refuses inside ``atomic()``) is
answered an RFC 9457 problem and logged, as is one that opens ``transaction.atomic(durable=True)``,
which Django refuses inside another block, and so is a streamed body whose generator does either
(the body is read inside the transaction before anything of it goes out, so the client gets the
problem alone); one that closes the connection (``connection.close()``, which rolls the request
back on the server) gets that problem too, never its own answer over writes that are gone; one
that ends it on the psycopg connection and runs nothing after has its claim settled apart, never
left in flight.

Not supported: writes on any other connection, which commit on their own (and a retry after a
failure makes them again): another thread's (``sync_to_async(..., thread_sensitive=False)`` in an
async view, a thread the view starts) or another database alias's.

Statements that Django's execute wrappers never see (``cursor.callproc()``, ``cursor.copy()``, the
psycopg connection's own ``execute()``) do not make the view begin; a success it then answers (a
status under 400) is kept anyway, with those writes, and a refusal rolls them back: call
:func:`begin` (or take the connection with ``psycopg_connection()``) to keep a refusal made after
such writes. A response body over ``MAX_RESPONSE_BYTES`` (answered 500, rolled back); a repeated
Idempotency-Key header is indistinguishable from one key containing a comma, because WSGI and
Django's ASGI handler join repeated headers with a comma before the middleware sees them; a header
repeated in a response (Django keeps one value per header name).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from types import FrameType
from typing import Any, TypeVar

import psycopg
from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.core.exceptions import RequestDataTooBig
from django.core.handlers.asgi import ASGIRequest
from django.db import InterfaceError, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from pgonce.contrib.django import conf
from pgonce.contrib.django.connection import check_backend, psycopg_connection
from pgonce.core.outcomes import InFlight, Replay, Won
from pgonce.database import reaches_server_directly
from pgonce.errors import (
    DatabaseUnavailable,
    InvalidIdempotencyKey,
    KeyMismatch,
    MissingKeyScope,
    UsageError,
)
from pgonce.http import semantics
from pgonce.http.semantics import IDLE, NO_WAIT, Answer, CapturedResponse, IdempotencyRules
from pgonce.store._sync.keys import EndedThenWrote, KeyStore

#: Where the request's claim is kept for :func:`begin` (``request.pgonce``).
REQUEST_ATTRIBUTE = "pgonce"

_UNAVAILABLE = (DatabaseUnavailable, psycopg.OperationalError, OperationalError, InterfaceError)

#: What Django's ``atomic()`` sends for its savepoints (``connection.ops.savepoint_*_sql``): they
#: write nothing, so a view inside ``ATOMIC_REQUESTS`` has not begun when its block opens.
_SAVEPOINT_SQL = ("SAVEPOINT ", "RELEASE SAVEPOINT ", "ROLLBACK TO SAVEPOINT ")
_ROLLBACK_SQL = "ROLLBACK TO SAVEPOINT "

#: The code of Django's ``Atomic.__exit__``, which rolls a block back to its savepoint, and how
#: many frames above the execute wrapper it is looked for (Django's cursor, its debug cursor,
#: ``savepoint_rollback()``, its ``async_unsafe`` wrapper and other execute wrappers are between).
_ATOMIC_EXIT = transaction.Atomic.__exit__.__code__
_FRAMES = 20

GetResponse = Callable[[HttpRequest], Any]
_T = TypeVar("_T")

#: Where Django refuses a commit, a rollback or a change of autocommit inside ``atomic()``.
_NO_ATOMIC_BLOCK = BaseDatabaseWrapper.validate_no_atomic_block.__code__


def _transaction_ended(refusal: TransactionManagementError) -> UsageError:
    """What a view did wrong when it tried to commit or roll back the request's transaction."""
    return UsageError(
        "the view runs in the idempotent request's transaction, which the Idempotency-Key "
        "middleware commits once the response is stored, and called connection.commit(), "
        f"rollback() or set_autocommit() on it (Django: {refusal}); nothing was committed. Let "
        "the middleware commit: undo a part with transaction.atomic() and "
        "transaction.set_rollback(True), or raise to undo it all"
    )


#: Where Django refuses a durable ``atomic()`` block nested in another block.
_ATOMIC_ENTER = transaction.Atomic.__enter__.__code__


def _durable_refused(refusal: RuntimeError) -> UsageError:
    """What a view did wrong when it opened a durable block inside the request's transaction."""
    return UsageError(
        "the view runs in the idempotent request's transaction, which the Idempotency-Key "
        "middleware commits once the response is stored, and opened "
        f"transaction.atomic(durable=True) in it, which must be the outermost block (Django: "
        f"{refusal}); nothing was committed. Drop durable=True from the view, or leave its "
        "route out of PGONCE['ROUTES']"
    )


def _closed(alias: str) -> UsageError:
    """What a view did wrong when it closed the connection of the request's transaction."""
    return UsageError(
        "the view runs in the idempotent request's transaction, which the Idempotency-Key "
        f"middleware commits once the response is stored, and closed its connection "
        f"(connections[{alias!r}].close()), which rolled it back: nothing was committed and "
        "the view's answer was not sent. Let the middleware end the transaction: undo a part "
        "with transaction.atomic() and transaction.set_rollback(True), or raise to undo it all"
    )


def _refused_ending(scope: str, exception: BaseException) -> HttpResponse | None:
    """The answer to a view that tried to end the request's transaction and was refused by
    Django (``connection.commit()``, ``rollback()``, ``set_autocommit()`` or a durable
    ``atomic()`` block), logged as a :class:`~pgonce.errors.UsageError`; ``None`` for any other
    exception. Django refused before doing anything, so the request rolls back whole."""
    if isinstance(exception, TransactionManagementError) and _ends_transaction(exception):
        semantics.log_transaction_ended(scope, _transaction_ended(exception))
        return to_django(semantics.TRANSACTION_ENDED)
    if isinstance(exception, RuntimeError) and _raised_in(exception, _ATOMIC_ENTER):
        # A durable block commits at its end: inside the request's transaction it would have
        # to end it, which Django refuses before running anything of the block.
        semantics.log_transaction_ended(scope, _durable_refused(exception))
        return to_django(semantics.TRANSACTION_ENDED)
    return None


def _raised_in(error: BaseException, code: Any) -> bool:
    """Whether ``error`` was raised by the function whose code is ``code`` itself."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and frame.tb_frame.f_code is code


def _ends_transaction(error: TransactionManagementError) -> bool:
    """Whether Django raised ``error`` refusing to end the transaction of an ``atomic()`` block
    (its ``validate_no_atomic_block()``), not for another misuse of a transaction."""
    return _raised_in(error, _NO_ATOMIC_BLOCK)


def _savepoint_gone(error: BaseException) -> bool:
    """Whether ``error`` is Django's for a savepoint that no longer exists, which in the request's
    transaction only a view that ended that transaction makes (a block's RELEASE or ROLLBACK TO
    at its end, in the transaction psycopg opened after the end)."""
    cause = error.__cause__
    return isinstance(cause, psycopg.errors.InvalidSavepointSpecification)


def _ended_in_block(error: BaseException) -> UsageError:
    """What a view did wrong when it ended the request's transaction inside an ``atomic()``
    block and ran on."""
    return UsageError(
        "the view runs in the idempotent request's transaction, which the Idempotency-Key "
        "middleware commits once the response is stored, and ended it inside an atomic() block "
        "(ATOMIC_REQUESTS' or its own) with a ROLLBACK or COMMIT of its own (raw SQL, or the "
        f"psycopg connection's rollback() or commit()); at the block's end (Django: {error}) "
        "everything it ran after that end was rolled back and its answer was not sent. A "
        "rollback took the claim with it, so the key is free; a commit committed the claim with "
        "the writes before it, unanswered, so the key stays in flight until it expires and no "
        "retry makes those writes again. Let the middleware end the transaction"
    )


class ClaimedRequest:
    """The key a request claimed; ``began`` turns true at the view's first query, ``raised``
    when the view raised (whatever response Django made of it), ``undone`` when the view's
    transaction was marked for rollback (see :meth:`_rolled_back`).

    It is also the execute wrapper (Django's ``connection.execute_wrapper()``) that sees that
    query, installed on the connection while the view runs and while its streamed body is read.
    """

    __slots__ = ("began", "depth", "ended", "first", "key", "raised", "scope", "undone")

    def __init__(self, scope: str, key: str, depth: int = 0) -> None:
        self.scope = scope
        self.key = key
        #: How many savepoints Django's atomic() blocks held in the middleware's block.
        self.depth = depth
        self.began = False
        self.raised = False
        self.undone = False
        #: The view ended the request's transaction and ran on, which its atomic() block found
        #: at its end (see process_exception()).
        self.ended = False
        #: The savepoint of the view's outermost atomic() block open when the view began (its
        #: name as Django's SQL quotes it), None when none was or it is not known.
        self.first: str | None = None

    def __call__(
        self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any
    ) -> Any:
        if self.began:
            if isinstance(sql, str) and sql.startswith(_ROLLBACK_SQL):
                self._rolled_back(context["connection"], sql)
            elif self.undone and not (isinstance(sql, str) and sql.startswith(_SAVEPOINT_SQL)):
                # The view went on after its block was rolled back: without the middleware
                # this would commit on its own, so the block was a part the view undid.
                self.undone = False
        elif not (isinstance(sql, str) and sql.startswith(_SAVEPOINT_SQL)):
            self.began_in(context["connection"])
        return execute(sql, params, many, context)

    def began_in(self, wrapper: BaseDatabaseWrapper) -> None:
        """The view begins (its first statement) on ``wrapper``: note the block it is in."""
        self.began = True
        ids = wrapper.savepoint_ids
        sid = ids[self.depth] if len(ids) > self.depth else None
        self.first = None if sid is None else wrapper.ops.quote_name(sid)

    def _rolled_back(self, wrapper: BaseDatabaseWrapper, sql: str) -> None:
        """A savepoint is rolled back: is it the view's transaction, marked for rollback?

        The view's transaction is the outermost ``atomic()`` block inside the middleware's
        (``ATOMIC_REQUESTS``' block, or the view's own): without the middleware it would be a
        transaction, and a rollback there undoes all of it. Django rolls it back to its
        savepoint when it ends marked for rollback (``transaction.set_rollback(True)``, as DRF's
        exception handler does under ``ATOMIC_REQUESTS``), and then nothing of the request may
        commit, the answer included. Not when an exception leaves it: the view either raised
        (``raised``) or caught the exception to go on, a partial undo (``get_or_create``'s way)
        whose answer is stored with the rest; nor for a block nested deeper, a partial undo too.
        Nor when the view ran anything outside that block, which without the middleware would
        have committed on its own: before it (the block is not the one the view began in) or
        after it (``__call__``); then too the block is a part the view undid.
        """
        if len(wrapper.savepoint_ids) != self.depth:
            return  # a block nested deeper: a part the view undoes
        if self.first is None or sql[len(_ROLLBACK_SQL) :] != self.first:
            return  # the view began before this block: a part it undoes
        frame: FrameType | None = sys._getframe(2)
        for _ in range(_FRAMES):
            if frame is None:
                return
            if frame.f_code is _ATOMIC_EXIT:
                # Atomic.__exit__(self, exc_type, ...): rolling back without an exception means
                # that the block was marked for rollback.
                self.undone = self.undone or frame.f_locals.get("exc_type") is None
                return
            frame = frame.f_back


def begin(request: HttpRequest) -> None:
    """Mark the view as begun without a query, so that its answer is stored and replayed.

    Raises :class:`UsageError` when the middleware claimed no key for this request.
    """
    claimed = getattr(request, REQUEST_ATTRIBUTE, None)
    if claimed == semantics.UNSCOPED:
        raise MissingKeyScope()  # the middleware answers 401
    if not isinstance(claimed, ClaimedRequest):
        raise UsageError(
            "this request has no claimed Idempotency-Key: the route must be covered by "
            "pgonce's IdempotencyMiddleware and carry a key"
        )
    claimed.began = True


def to_django(answer: Answer) -> HttpResponse:
    """An :class:`~pgonce.http.semantics.Answer` as a Django response, headers as they are."""
    response = HttpResponse(answer.body, status=answer.status)
    names = set()
    for name, value in answer.headers:
        text = name.decode("latin-1")
        names.add(text)
        response[text] = value.decode("latin-1")
    if "content-type" not in names:
        del response["Content-Type"]  # Django's default would not be the stored response's
    return response


class IdempotencyMiddleware:
    """``MIDDLEWARE = [..., "pgonce.contrib.django.middleware.IdempotencyMiddleware", ...]``.

    Place it after the middleware the scope function needs (``AuthenticationMiddleware`` for
    :func:`~pgonce.contrib.django.scopes.user_scope`) and before those whose answers must be
    part of the stored response.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: GetResponse) -> None:
        self.get_response = get_response
        self.settings = settings = conf.load()
        self.using = settings.database
        check_backend(self.using)
        self.rules = IdempotencyRules(
            methods=settings.methods,
            routes=settings.routes,
            require_key=settings.require_key,
            canonicalize_json=settings.canonicalize_json,
            max_request_bytes=settings.max_request_bytes,
            max_response_bytes=settings.max_response_bytes,
            retention=settings.retention,
        )
        self.store, self.direct_store = (
            KeyStore(
                schema=settings.schema,
                wait=settings.wait if settings.wait is not None else NO_WAIT,
                store_server_errors=settings.store_server_errors,
                pooler=pooler,
            )
            for pooler in (settings.pooler, "none")
        )
        #: Per psycopg connection, the store that runs on it (POOLER "auto": checked once).
        self._stores: weakref.WeakKeyDictionary[psycopg.Connection[Any], KeyStore] = (
            weakref.WeakKeyDictionary()
        )
        self._auto = settings.pooler == "auto"
        #: The scope function, looked up once rather than through the settings per request.
        self._scope = settings.scope
        #: One atomic block for every request, as ``@transaction.atomic`` makes one for every call
        #: of the function it decorates: Django keeps a block's state on the thread's
        #: connection, never on the block, so threads share it safely.
        self._atomic = transaction.atomic(using=self.using)
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        checked = self._check(request)
        if checked is None:
            return self.get_response(request)
        if isinstance(checked, Answer):
            return to_django(checked)
        return self._handle(request, checked, self.get_response)

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        checked = self._check(request)
        if checked is None:
            response: HttpResponseBase = await self.get_response(request)
            return response
        if isinstance(checked, Answer):
            return to_django(checked)
        # The whole transaction in one thread: Django's connection belongs to a thread, and the
        # view's own sync_to_async calls come back to this one while it waits for the view.
        handle = sync_to_async(self._handle, thread_sensitive=True)
        return await handle(request, checked, async_to_sync(self.get_response))

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """Django calls this for an exception the view raised, before it turns it into a response
        (404, 403, 400 or 500), which then reaches the middleware as if the view had returned it.

        For a claimed request the view is marked as raised, so that its writes roll back with the
        claim and nothing is stored: the retry runs the view again. A view that lost the database
        is answered 503 with Retry-After, as the middleware answers when its own calls lose it. A
        view that asked for the claim of a request whose key scope named no caller: 401. A view
        that tried to end the request's transaction (``connection.commit()``, ``rollback()`` or
        ``set_autocommit()``, which Django refuses inside the middleware's ``atomic()`` block):
        the problem answer of :data:`~pgonce.http.semantics.TRANSACTION_ENDED`, logged as a
        :class:`~pgonce.errors.UsageError`, never Django's 500 page.
        """
        if isinstance(exception, MissingKeyScope):
            return to_django(semantics.MISSING_SCOPE)
        claimed = getattr(request, REQUEST_ATTRIBUTE, None)
        if not isinstance(claimed, ClaimedRequest):
            return None
        claimed.raised = True
        if _savepoint_gone(exception):
            # Django's atomic() block around the view (ATOMIC_REQUESTS', or the view's own)
            # found its savepoint gone at its end: the view ended the request's transaction
            # itself and ran on in the one psycopg opened next. Not a lost database: the
            # middleware rolls that transaction back, and the client is told what happened.
            semantics.log_transaction_ended(claimed.scope, _ended_in_block(exception))
            claimed.ended = True
            return to_django(semantics.TRANSACTION_ENDED)
        if isinstance(exception, _UNAVAILABLE):
            semantics.log_unavailable(claimed.scope, exception)
            return to_django(semantics.unavailable(self.store.retry_after))
        return _refused_ending(claimed.scope, exception)

    def _check(self, request: HttpRequest) -> str | Answer | None:
        """The request's key; an answer to give at once; ``None``: pass the request through."""
        rules = self.rules
        if not rules.applies(request.method or "", request.path_info):
            return None
        meta = request.META
        try:
            key = rules.joined_key(meta.get("HTTP_IDEMPOTENCY_KEY"))
        except InvalidIdempotencyKey as error:
            return semantics.invalid_key(error)
        if key is None:
            return semantics.MISSING_KEY if rules.require_key else None
        if rules.declared_too_large(meta.get("CONTENT_LENGTH")):
            return rules.request_too_large
        return key

    def _handle(self, request: HttpRequest, key: str, view: GetResponse) -> HttpResponseBase:
        try:
            caller = self._scope(request)
        except _UNAVAILABLE:
            # The scope read the database (user_scope loads the session's user) and lost it:
            # nothing was claimed or done, and the retry runs the request.
            return to_django(semantics.unavailable(self.store.retry_after))
        if caller is None:
            setattr(request, REQUEST_ATTRIBUTE, semantics.UNSCOPED)
            response: HttpResponseBase = view(request)
            return response
        rules = self.rules
        try:
            body = request.body
        except RequestDataTooBig:
            return to_django(rules.request_too_large)
        if len(body) > rules.max_request_bytes:
            return to_django(rules.request_too_large)
        fingerprint = rules.fingerprint(
            request.method or "",
            request.path,
            _query_bytes(request),
            body,
            request.META.get("CONTENT_TYPE"),
        )
        try:
            return self._transact(request, caller, key, fingerprint, view)
        except KeyMismatch:
            return to_django(semantics.MISMATCH)
        except _UNAVAILABLE as error:
            semantics.log_unavailable(caller, error)
            return to_django(semantics.unavailable(self.store.retry_after))

    def _store_for(self, wrapper: BaseDatabaseWrapper) -> KeyStore:
        """The key store for Django's connection now: with POOLER "auto", one that prepares its
        statements where the connection reaches PostgreSQL itself (checked once per
        connection, outside a transaction), since Django turns psycopg's preparing off for
        every connection."""
        if not self._auto:
            return self.store
        conn = wrapper.connection
        if conn is None:
            wrapper.ensure_connection()
            conn = wrapper.connection
        store = self._stores.get(conn)
        if store is None:
            direct = conn.prepare_threshold is None and reaches_server_directly(conn)
            store = self._stores[conn] = self.direct_store if direct else self.store
        return store

    def _transact(
        self, request: HttpRequest, caller: str, key: str, fingerprint: bytes, view: GetResponse
    ) -> HttpResponseBase:
        using = self.using
        # The thread's connection wrapper, looked up once: every lookup goes through Django's
        # thread-and-task-local connection handler.
        wrapper = connections[using]
        store = self.store
        if self._auto:
            # A connection seen before is found without a call; a new one is checked once.
            conn = wrapper.connection
            store = (conn is not None and self._stores.get(conn)) or self._store_for(wrapper)
        # Outermost, the middleware owns the request's transaction (it opened it), so BEGIN
        # travels with the claim and the completion with COMMIT: three round trips with the
        # view's one statement, as in the ASGI middleware. Inside someone else's atomic() block
        # it joins that transaction instead and never ends it.
        owned = not wrapper.in_atomic_block
        rules = self.rules
        with self._atomic:
            conn = wrapper.connection  # atomic() connected it
            if not isinstance(conn, psycopg.Connection):
                conn = psycopg_connection(using)  # raises what is wrong
            owned = owned and conn.pgconn.transaction_status == IDLE
            claim = (store.begin if owned else store.claim)(conn, caller, key, fingerprint)
            if not isinstance(claim, Won):
                # The claim wrote nothing (begin() has already ended its transaction).
                wrapper.set_rollback(True)
                if isinstance(claim, Replay):
                    return to_django(rules.replay(claim))
                assert isinstance(claim, InFlight)
                return to_django(semantics.in_flight(claim))
            claimed = ClaimedRequest(caller, key, len(wrapper.savepoint_ids))
            setattr(request, REQUEST_ATTRIBUTE, claimed)
            # What connection.execute_wrapper(claimed) does, without its two context managers.
            wrappers = wrapper.execute_wrappers
            wrappers.append(claimed)
            # The view's transaction.on_commit() hooks (an e-mail, a task) are effects of the
            # view too: they run only if the request's transaction commits.
            hooks = len(wrapper.run_on_commit)
            try:
                response: HttpResponseBase = view(request)
                # A streamed body is produced here, still inside the transaction: the queries of
                # its generator are the view's, and its writes commit with the stored response.
                try:
                    captured = _capture(response, rules.capture())
                except (TransactionManagementError, RuntimeError) as error:
                    # Raised by the generator after the view returned, where Django's
                    # process_exception() never sees it; nothing of the body has gone out.
                    refusal = _refused_ending(caller, error)
                    if refusal is None:
                        raise
                    wrapper.set_rollback(True)
                    return refusal
            finally:
                wrappers.pop()
            # A view that raised, or marked its transaction for rollback (set_rollback: on the
            # middleware's block, or on the view's outermost block, which Django has rolled back
            # to its savepoint), must not commit; nor one that caught the error of its own
            # statement and answered (the transaction is aborted). Its answer goes out, not
            # stored, and the key stays free.
            # A success (a status under 400) counts as begun even when Django saw no query of
            # the view: psycopg runs statements that Django's execute wrappers never see
            # (cursor.callproc(), cursor.copy(), the psycopg connection's own execute()), and
            # a success rolled back over such writes would tell the client they were made while
            # the retry made them again. A refusal before the first query is a 4xx: not kept.
            began = (
                (
                    claimed.began
                    or len(wrapper.run_on_commit) > hooks
                    or (captured.status is not None and captured.status < 400)
                )
                and not claimed.raised
                and not claimed.undone
                and not wrapper.needs_rollback  # get_rollback(), inside the block
            )
            kept = captured.keep(began=began, status_kept=store.stores_status)
            status = conn.pgconn.transaction_status
            # A view's connection.close() on a pooled alias (OPTIONS["pool"]) gives the
            # connection back to the pool, which rolls it back: idle then, and no longer ours.
            closed = wrapper.closed_in_transaction
            if status == IDLE and not closed:
                # The view committed or rolled back the request's transaction on the psycopg
                # connection itself and ran nothing since: the claim is settled on its own,
                # never left in flight, and the log says what was wrong.
                _settle(store, conn, claim, captured)
            elif closed or not (kept and captured.commits(status)):
                wrapper.set_rollback(True)
                if closed and (claimed.raised or captured.status is None or captured.status < 500):
                    # The view closed the connection (connection.close()): the server rolled
                    # the request back, its writes too, and its answer must not say otherwise
                    # (nor Django's for what the view then raised, the 503 of a connection
                    # "lost"). A 5xx the view returned itself says so already.
                    semantics.log_transaction_ended(caller, _closed(wrapper.alias))
                    captured.ended = True
            else:
                # The completion and COMMIT in one round trip; Django's own COMMIT at the end
                # of the block then finds the transaction over and sends nothing. What COMMIT
                # finds wrong in the view's writes (a deferred foreign key) is raised as Django
                # raises it from its own COMMIT: django.db.IntegrityError, not psycopg's.
                try:
                    found = (
                        store.commit(conn, claim, captured.response())
                        if owned
                        else store.complete(conn, claim, captured.response())
                    )
                except psycopg.Error:
                    # Made Django's exception (wrap_database_errors), entered only when needed.
                    with wrapper.wrap_database_errors:
                        raise
                except EndedThenWrote as error:
                    # The view ended the request's transaction on the psycopg connection and
                    # wrote on in the one psycopg opened next: commit() found the end and
                    # rolled back what ran after it. The view's answer was made after those
                    # writes, which are gone (a 201 may name a row never made): neither sent
                    # nor stored. The claim stays as the end left it: rolled back (the key is
                    # free), or committed with the writes before the end and in flight until
                    # it expires, so that no retry makes those again.
                    captured.ended_then_wrote(claim, error, committed=store.committed(conn, claim))
                    found = True
                if not found:
                    # The view ended the transaction on the psycopg connection itself and
                    # wrote in a new one: no claim was left to complete.
                    captured.claim_lost(claim)
        # Committed (or rolled back): only now is the answer given out.
        if claimed.ended and store.committed(conn, claim):
            # The view committed the claim with its writes before the end its atomic() block
            # found: the answer says so (process_exception() could not know it yet).
            return to_django(semantics.TRANSACTION_ENDED_COMMITTED)
        if captured.too_large:
            return to_django(semantics.RESPONSE_TOO_LARGE)
        if captured.ended:
            return to_django(captured.ended_answer)
        if captured.stored:
            name, value = rules.expires_text_header(claim.claimed_at)
            _set_header(response, name, value)
        return response


def _settle(
    store: KeyStore, conn: psycopg.Connection[Any], claim: Won, captured: CapturedResponse
) -> None:
    """Complete (or release) ``claim`` in a transaction of its own on the idle ``conn``, after
    the view ended the request's transaction (see
    :meth:`~pgonce.http.semantics.CapturedResponse.ended_by_endpoint`)."""
    found: bool | None = None
    if captured.stored:
        found = store.complete(conn, claim, captured.response())
    else:
        store.release(conn, claim)
    conn.commit()
    captured.ended_by_endpoint(claim, found=found)


def _query_bytes(request: HttpRequest) -> bytes:
    """The query string as the client sent it, so that the fingerprint is the ASGI
    middleware's for the same request: under ASGI the scope's raw bytes (Django decoded them as
    UTF-8, not Latin-1), under WSGI the environ's Latin-1 text encoded back (PEP 3333)."""
    if isinstance(request, ASGIRequest):
        query = request.scope.get("query_string", b"")
        # Text only from Django's own AsyncClient, which Django's handler reads as it is.
        return query.encode() if isinstance(query, str) else bytes(query)
    text: str = request.META.get("QUERY_STRING", "")
    return text.encode("latin-1")


def _header_pairs(response: HttpResponseBase) -> list[tuple[str, str]]:
    """``list(response.items())``: the response's headers as text, in order, as Django checked
    them (ASCII names, latin-1 or MIME-encoded values).

    Read where Django's ``ResponseHeaders`` keeps them when it does (a dict of ``(name, value)``
    pairs under the lower-cased name): its items view makes three Python calls of each header,
    some 90 bytecodes of a response."""
    pairs = getattr(response.headers, "_store", None)
    if type(pairs) is dict:
        return list(pairs.values())
    return list(response.items())


def _set_header(response: HttpResponseBase, name: str, value: str) -> None:
    """``response[name] = value`` for a header of pgonce's own (a lower-case ASCII name, an
    ASCII value without line breaks: what Django's checks, some 80 bytecodes, would find),
    put where :func:`_header_pairs` reads Django's headers, when they are there."""
    pairs = getattr(response.headers, "_store", None)
    if type(pairs) is dict:
        pairs[name] = (name, value)
    else:
        response[name] = value


def _capture(response: HttpResponseBase, captured: CapturedResponse) -> CapturedResponse:
    """Read the view's response into ``captured``; a streamed body is buffered (and re-set)."""
    captured.status = response.status_code
    captured.text_headers = _header_pairs(response)
    if response.streaming:
        # The view's own iterator, not Django's wrapper of it (a map, or an async generator
        # of its own, whose closing never reaches the view's): a body cut at the limit closes
        # it here, inside the transaction, so that what its ``finally`` writes rolls back with
        # the rest instead of committing on its own after it.
        content = response._iterator
        # Django put the body's close() among the response's closers, for the server to call
        # once the body is sent: it runs here instead, inside the transaction, and must not run
        # again after the commit, where a close() that writes would write a second time, alone.
        close = getattr(content, "close", None)
        if close is not None:
            closers = response._resource_closers
            while close in closers:
                closers.remove(close)
        if getattr(response, "is_async", False):
            # An async iterator (``async def`` generator) is read on the event loop; its ORM
            # calls (``acreate()``, ``sync_to_async``) come back to this thread, into the
            # transaction, as the view's do.
            chunks = async_to_sync(_read)(content, response.make_bytes, captured)
            response.streaming_content = _replay_async(chunks)
        else:
            chunks = _at_once(_read(_Synchronous(content), response.make_bytes, captured))
            response.streaming_content = chunks
        captured.add(b"", more=False)
    else:
        captured.add(response.content, more=False)
    return captured


async def _read(
    content: AsyncIterator[Any], make_bytes: Callable[[Any], bytes], captured: CapturedResponse
) -> list[bytes]:
    """Read a streamed body into ``captured`` until it ends or outgrows the limit, then close the
    view's iterator: the one reader of both kinds of body, an async one awaited on the event
    loop, a synchronous one (wrapped in :class:`_Synchronous`) run at once by :func:`_at_once`."""
    chunks: list[bytes] = []
    try:
        async for part in content:
            chunk = make_bytes(part)
            captured.add(chunk, more=True)
            if captured.too_large:
                break
            chunks.append(chunk)
    finally:
        close = getattr(content, "aclose", None)
        if close is not None:
            await close()
    return chunks


_END = object()


class _Synchronous:
    """A synchronous iterator as an async one whose steps never suspend (for :func:`_read`)."""

    __slots__ = ("_content", "_parts")

    def __init__(self, content: Iterable[Any]) -> None:
        self._content = content

    def __aiter__(self) -> _Synchronous:
        self._parts = iter(self._content)
        return self

    async def __anext__(self) -> Any:
        part = next(self._parts, _END)
        if part is _END:
            raise StopAsyncIteration
        return part

    async def aclose(self) -> None:
        close = getattr(self._content, "close", None)
        if close is not None:
            close()


def _at_once(steps: Coroutine[Any, Any, _T]) -> _T:
    """Run ``steps``, which awaits nothing that suspends, to its end in this thread."""
    try:
        steps.send(None)
    except StopIteration as done:
        result: _T = done.value
        return result
    steps.close()
    raise RuntimeError("a synchronous body's reader suspended")


async def _replay_async(chunks: list[bytes]) -> AsyncIterator[bytes]:
    """The buffered body, served as the async iterator it was (Django's ASGI handler would
    otherwise warn about a synchronous one)."""
    for chunk in chunks:
        yield chunk
