"""pgonce: exactly-once API calls, webhook deliveries and event publishing on PostgreSQL.

A unique key in PostgreSQL is the serialization point: the claim of a key, the caller's writes, the
stored response and any outbox rows commit in one transaction on the caller's connection.
"""

from pgonce._version import __version__
from pgonce.config import Settings
from pgonce.core.fingerprint import fingerprint
from pgonce.core.outbox import OutboxEvent
from pgonce.core.outcomes import Claim, InFlight, Replay, Response, Won
from pgonce.core.retention import HealthReport, Retention, RetentionPolicy, SweepLimits, SweepResult
from pgonce.decorator import idempotent
from pgonce.errors import (
    BrokerUnavailable,
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    KeyInFlight,
    KeyMismatch,
    LeaseLost,
    MissingExtra,
    NotInTransaction,
    PgonceError,
    PublishError,
    SchemaNotMigrated,
    UsageError,
)
from pgonce.store._async.health import AsyncHealthCheck
from pgonce.store._async.keys import AsyncKeyStore, AsyncOperation
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store._async.sweeper import AsyncSweeper, sweep_every, swept_before
from pgonce.store._sync.health import HealthCheck
from pgonce.store._sync.keys import KeyStore, Operation
from pgonce.store._sync.outbox import OutboxStore, enqueue, enqueue_many
from pgonce.store._sync.sweeper import Sweeper

__all__ = [
    "AsyncHealthCheck",
    "AsyncKeyStore",
    "AsyncOperation",
    "AsyncOutboxStore",
    "AsyncSweeper",
    "BrokerUnavailable",
    "Claim",
    "ConfigError",
    "DatabaseError",
    "DatabaseUnavailable",
    "HealthCheck",
    "HealthReport",
    "InFlight",
    "KeyInFlight",
    "KeyMismatch",
    "KeyStore",
    "LeaseLost",
    "MissingExtra",
    "NotInTransaction",
    "Operation",
    "OutboxEvent",
    "OutboxStore",
    "PgonceError",
    "PublishError",
    "Replay",
    "Response",
    "Retention",
    "RetentionPolicy",
    "SchemaNotMigrated",
    "Settings",
    "SweepLimits",
    "SweepResult",
    "Sweeper",
    "UsageError",
    "Won",
    "__version__",
    "enqueue",
    "enqueue_many",
    "fingerprint",
    "idempotent",
    "sweep_every",
    "swept_before",
]
