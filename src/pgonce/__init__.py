"""pgonce: exactly-once API calls, webhook deliveries and event publishing on PostgreSQL.

A unique key in PostgreSQL is the serialization point: the claim of a key, the caller's writes, the
stored response and any outbox rows commit in one transaction on the caller's connection.
"""

from pgonce.config import Settings
from pgonce.core.fingerprint import fingerprint
from pgonce.core.outcomes import Claim, InFlight, Replay, Response, Won
from pgonce.errors import (
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    KeyMismatch,
    NotInTransaction,
    PgonceError,
    SchemaNotMigrated,
    UsageError,
)
from pgonce.store._async.keys import AsyncKeyStore, AsyncOperation
from pgonce.store._sync.keys import KeyStore, Operation

__all__ = [
    "AsyncKeyStore",
    "AsyncOperation",
    "Claim",
    "ConfigError",
    "DatabaseError",
    "DatabaseUnavailable",
    "InFlight",
    "KeyMismatch",
    "KeyStore",
    "NotInTransaction",
    "Operation",
    "PgonceError",
    "Replay",
    "Response",
    "SchemaNotMigrated",
    "Settings",
    "UsageError",
    "Won",
    "fingerprint",
]
