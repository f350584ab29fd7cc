"""HTTP edges: the Idempotency-Key middleware and RFC 9457 problem responses.

The ASGI parts are loaded when first named (``pgonce.http.IdempotencyMiddleware``), so that the
framework-neutral modules of this package (:mod:`pgonce.http.semantics`, which the WSGI and Django
adapters share) import without the ``asgi`` extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pgonce.http.middleware import IdempotencyMiddleware, header_scope
    from pgonce.http.transaction import (
        IdempotentTransaction,
        connection,
        idempotent_transaction,
        phased,
        transaction_of,
    )

_HOMES = {
    "IdempotencyMiddleware": "pgonce.http.middleware",
    "header_scope": "pgonce.http.middleware",
    "IdempotentTransaction": "pgonce.http.transaction",
    "connection": "pgonce.http.transaction",
    "idempotent_transaction": "pgonce.http.transaction",
    "phased": "pgonce.http.transaction",
    "transaction_of": "pgonce.http.transaction",
}

__all__ = [
    "IdempotencyMiddleware",
    "IdempotentTransaction",
    "connection",
    "header_scope",
    "idempotent_transaction",
    "phased",
    "transaction_of",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pgonce.http' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
