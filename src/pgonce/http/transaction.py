"""How an endpoint joins the transaction in which the middleware claimed its Idempotency-Key.

The middleware puts an :class:`IdempotentTransaction` into the ASGI scope's ``state``. The endpoint
takes the connection from it and writes on it; the claim, those writes and the stored response then
commit together, or not at all.

Taking the connection is also how the middleware learns that the endpoint *began*: a response is
stored only if the endpoint took the connection (or called :meth:`IdempotentTransaction.begin`).
A 400, 401 or 422 that the framework produced before the endpoint ran (authentication, request
validation) is therefore never stored, and the retry runs normally — Stripe's rule: results are
saved only once the endpoint's execution began.

Starlette::

    async def create(request: Request) -> Response:
        conn = connection(request)
        await conn.execute("INSERT ...")

FastAPI (the dependency is resolved before FastAPI reports validation errors, so the dependency
hands out the transaction and the endpoint takes the connection itself)::

    @app.post("/payments")
    async def create(body: Payment, tx: IdempotentTransaction = Depends(idempotent_transaction)):
        await tx.connection.execute("INSERT ...")

or, with no dependency for FastAPI to resolve, through the Starlette helper:
``async def create(body: Payment, request: Request)`` and ``connection(request)`` inside.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from pgonce.errors import MissingKeyScope, UsageError
from pgonce.extras import needs
from pgonce.http.semantics import UNSCOPED, PhasedRequest
from pgonce.store._async.phases import AsyncPhasedOperation

with needs("asgi", "the Idempotency-Key middleware"):
    from starlette.requests import HTTPConnection

#: Where the middleware puts the transaction, in ``scope["state"]`` (``request.state``).
STATE_KEY = "pgonce.transaction"


class IdempotentTransaction:
    """The claimed key's transaction, handed to one request's endpoint."""

    __slots__ = ("_connection", "began", "failed", "key", "scope")

    def __init__(self, connection: AsyncConnection[Any], scope: str, key: str) -> None:
        self._connection = connection
        self.scope = scope
        self.key = key
        #: True once the endpoint took the connection or called :meth:`begin`.
        self.began = False
        #: True once the endpoint's work failed (see :meth:`fail`).
        self.failed = False

    @property
    def connection(self) -> AsyncConnection[Any]:
        """The connection, inside the claim's transaction; taking it marks the endpoint as begun.

        Never commit or roll back on it: the middleware commits after storing the response.
        """
        self.began = True
        return self._connection

    def begin(self) -> None:
        """Mark the endpoint as begun without using the database (its response will be stored)."""
        self.began = True

    def fail(self) -> None:
        """Mark the endpoint's work as failed although it answers: the transaction rolls back
        and the answer is not stored, so the retry runs again. For an exception that the
        framework turns into a response inside the middleware (Starlette's ``HTTPException``
        handlers): :func:`~pgonce.contrib.sqlalchemy.idempotent_session` calls it when the
        endpoint raised."""
        self.failed = True


#: Where the middleware puts a two-phase request's :class:`PhasedRequest`.
PHASED_KEY = "pgonce.phased"


def phased(request: HTTPConnection) -> AsyncPhasedOperation[Any]:
    """Starlette helper: the two-phase operation of a request on a ``two_phase`` route.

    The endpoint runs its phases on it (``await op.phase(...)``, ``await op.call(...)``) and
    returns its response as usual; the middleware stores it with the holder's fencing token.
    Taking it marks the endpoint as begun. Raises :class:`UsageError` on any other route.
    """
    holder = (request.scope.get("state") or {}).get(PHASED_KEY)
    if (request.scope.get("state") or {}).get(STATE_KEY) == UNSCOPED:
        raise MissingKeyScope()  # the middleware answers 401
    if not isinstance(holder, PhasedRequest):
        raise UsageError(
            "this request has no two-phase operation: its route must be among the "
            "IdempotencyMiddleware's two_phase routes, with an Idempotency-Key"
        )
    operation: AsyncPhasedOperation[Any] = holder.operation
    return operation


def transaction_of(request: HTTPConnection) -> IdempotentTransaction:
    """Starlette helper: the request's :class:`IdempotentTransaction`.

    Raises :class:`UsageError` when the middleware did not claim a key for this request, and
    :class:`MissingKeyScope` (answered 401 by the middleware) when it could not, because the key
    scope named no caller.
    """
    state = request.scope.get("state") or {}
    tx = state.get(STATE_KEY)
    if isinstance(tx, IdempotentTransaction):
        return tx
    if tx == UNSCOPED:
        raise MissingKeyScope()  # the middleware answers 401
    if isinstance(state.get(PHASED_KEY), PhasedRequest):
        raise UsageError(
            "this request is on a two_phase route, which has no request transaction: each "
            "phase commits its own; take the operation with phased(request) and write inside "
            "its phases (op.phase(...))"
        )
    raise UsageError(
        "this request has no idempotent transaction: the route must be covered by "
        "IdempotencyMiddleware with an Idempotency-Key (check its methods and routes)"
    )


async def idempotent_transaction(request: HTTPConnection) -> IdempotentTransaction:
    """FastAPI dependency: the request's :class:`IdempotentTransaction`.

    A coroutine on purpose: FastAPI runs plain functions in a thread pool, a hop that costs more
    than the lookup.
    """
    return transaction_of(request)


def connection(request: HTTPConnection) -> AsyncConnection[Any]:
    """Starlette helper: the claim's connection; call it inside the endpoint (it marks it begun)."""
    return transaction_of(request).connection
