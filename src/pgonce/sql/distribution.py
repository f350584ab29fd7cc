"""How pgonce's tables spread over a distributed PostgreSQL (Citus), in one place.

Each distributed table has a *distribution column*: the value that picks the table's shard, and so
the node. pgonce's rule (docs/concepts/beyond-one-primary.md) is that a claim and the writes it
protects stay on one shard, which holds when

- every unique key of a table contains its distribution column (Citus refuses any other: it can
  check uniqueness only within a shard);
- the tables one of pgonce's transactions writes together share the column's type and collation
  (Citus co-locates only such tables: their rows with the same value share a node);
- no statement's correctness depends on a row's physical address (``ctid``, per shard), an
  advisory lock or session state (a lock or setting lives on one node and one connection).

tests/test_schema_rules.py holds the schema (schema.sql, as the migrations build it) and the
runtime statements (queries/*.sql) to these rules.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Table -> its distribution column; ``None``: a *reference* table, copied to every node (small,
#: rarely written, read inside single-shard transactions) or kept on the coordinator.
DISTRIBUTION: Mapping[str, str | None] = {
    # The caller's scope (tenant, principal): the application's own tables distributed by the
    # same value keep the claim and the business write on one shard.
    "keys": "scope",
    # A two-phase key's lease, beside its keys row: each phase's transaction writes both.
    "key_leases": "scope",
    # The webhook source: the inbox's claim by workers reads one source at a time.
    "inbox": "source",
    "inbox_watermarks": "source",
    # The aggregate: its events keep their order on one shard, beside the aggregate's lock row.
    "outbox": "aggregateid",
    "outbox_aggregates": "aggregateid",
    # Relays waiting for a notification: a handful of rows, read by every enqueue.
    "outbox_waiting_relays": None,
    # Inbox worker loops waiting for a notification: as outbox_waiting_relays, for inbox_store().
    "inbox_waiting_workers": None,
    # What the sweeper deleted, per target and scope: one row each, written by sweep batches.
    "sweep_marks": None,
    # The migrations applied: written by `pgonce migrate` only.
    "schema_migrations": None,
}

#: Tables one of pgonce's own transactions writes together: they must be co-located.
WRITTEN_TOGETHER: tuple[tuple[str, ...], ...] = (
    ("outbox", "outbox_aggregates"),
    ("inbox", "inbox_watermarks"),
    ("keys", "key_leases"),
)
