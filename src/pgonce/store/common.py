"""What the async and sync store code share that does no I/O: checks, row conversion, statements."""

from __future__ import annotations

from typing import Any, Protocol

from psycopg.pq import TransactionStatus

from pgonce.core.outcomes import ClaimRow
from pgonce.errors import NotInTransaction
from pgonce.sql import Queries


class _HasTransactionState(Protocol):
    @property
    def autocommit(self) -> bool: ...
    @property
    def info(self) -> Any: ...


def require_transaction(conn: _HasTransactionState) -> None:
    """Refuse an autocommit connection outside a transaction: the write would commit alone."""
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise NotInTransaction()


def claim_row(row: tuple[Any, ...] | None) -> ClaimRow:
    # claim() always returns exactly one row; None would mean the function itself is broken.
    assert row is not None, "claim() returned no row"
    state, fingerprint, claimed_at, completed_at, status, headers, body = row
    return ClaimRow(state, fingerprint, claimed_at, completed_at, status, headers, body)


def complete_claimed(schema: str) -> bytes:
    """commit()'s completion of a claim of begin(): the completion, narrowed to the row's ctid."""
    return Queries("keys", schema).complete + b" AND ctid = %(row)s::tid"
