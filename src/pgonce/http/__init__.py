"""HTTP edges: the Idempotency-Key middleware and RFC 9457 problem responses."""

from pgonce.http.middleware import IdempotencyMiddleware, header_scope
from pgonce.http.transaction import (
    IdempotentTransaction,
    connection,
    idempotent_transaction,
    transaction_of,
)

__all__ = [
    "IdempotencyMiddleware",
    "IdempotentTransaction",
    "connection",
    "header_scope",
    "idempotent_transaction",
    "transaction_of",
]
