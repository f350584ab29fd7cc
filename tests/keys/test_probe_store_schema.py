"""A store built for a schema ``pgonce migrate`` could never make is refused at construction.

Taken as it was, the name was found out at the first call: a ``SchemaNotMigrated`` telling to run
``pgonce migrate``, which refuses that name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pgonce import (
    AsyncHealthCheck,
    AsyncKeyStore,
    AsyncOutboxStore,
    AsyncSweeper,
    HealthCheck,
    KeyStore,
    OutboxStore,
    Sweeper,
)
from pgonce.errors import UsageError
from pgonce.store._async.console import AsyncConsoleReader
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store._async.inspect import AsyncInspector
from pgonce.store._async.phases import AsyncPhaseStore
from pgonce.store._sync.console import ConsoleReader
from pgonce.store._sync.inbox import InboxStore
from pgonce.store._sync.inspect import Inspector
from pgonce.store._sync.phases import PhaseStore

STORES: list[Callable[..., Any]] = [
    KeyStore,
    AsyncKeyStore,
    PhaseStore,
    AsyncPhaseStore,
    InboxStore,
    AsyncInboxStore,
    OutboxStore,
    AsyncOutboxStore,
    Sweeper,
    AsyncSweeper,
    HealthCheck,
    AsyncHealthCheck,
    Inspector,
    AsyncInspector,
    ConsoleReader,
    AsyncConsoleReader,
]


@pytest.mark.parametrize("store", STORES, ids=lambda s: s.__name__)
@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ("Billing", "is not allowed"),
        ("pg_billing", "PostgreSQL's own"),
        ("billing-eu", "is not allowed"),
        (None, "must be a str"),
    ],
)
def test_a_schema_pgonce_cannot_have_is_refused(
    store: Callable[..., Any], schema: object, said: str
) -> None:
    with pytest.raises(UsageError, match=said):
        store(schema=schema)


@pytest.mark.parametrize("store", STORES, ids=lambda s: s.__name__)
def test_a_schema_pgonce_can_have_is_taken(store: Callable[..., Any]) -> None:
    store(schema="billing_eu")
