"""Every index on pgonce's tables is read by the statement it exists for, and no other exists.

Each index costs every write an entry (or at least a look at its predicate): one that no statement
reads is a cost with no benefit, as the BRIN indexes on keys.claimed_at and inbox.received_at were
from 0004 and 0005 until 0008 dropped them. Plans are read with sequential scans priced out, so
that a small table shows which index a statement can use; one that can use none still scans.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce import sql as pgsql

DAY = timedelta(days=1)
SWEEP = {
    "now": None,
    "scopes": ["webhooks"],
    "keeps": [7 * DAY],
    "min_keep": DAY,
    "default_keep": DAY,
    "batch_size": 500,
}

FILL = {
    "keys": """
        INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at)
        SELECT 's', g::text, sha256(g::text::bytea), now() - g * interval '1 minute',
               CASE WHEN g % 100 = 0 THEN NULL ELSE now() - g * interval '1 minute' END
          FROM generate_series(1, 5000) AS g""",
    "inbox": """
        INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, received_at, status,
                                  next_attempt_at, ordering_key, processed_at)
        SELECT 'github', g::text, '{}', '{}', sha256(g::text::bytea),
               now() - g * interval '1 minute', s.status, now(),
               CASE WHEN g % 3 = 0 THEN (g % 50)::text END,
               CASE WHEN s.status = 'pending' THEN NULL ELSE now() END
          FROM generate_series(1, 5000) AS g,
               LATERAL (SELECT CASE WHEN g % 10 = 0 THEN 'pending' ELSE 'done' END) AS s(status)""",
    "outbox": """
        INSERT INTO pgonce.outbox (aggregatetype, aggregateid, type, payload, created_at,
                                   published_at, parked_at, next_attempt_at)
        SELECT 'order', (g % 500)::text, 'order.created', '{}', now(),
               CASE WHEN g % 10 > 1 THEN now() - g * interval '1 minute' END,
               CASE WHEN g % 10 = 1 THEN now() END, now()
          FROM generate_series(1, 5000) AS g""",
    "outbox_aggregates": """
        INSERT INTO pgonce.outbox_aggregates (aggregatetype, aggregateid, events, last_enqueued_at)
        SELECT 'order', g::text, 1, now() - g * interval '1 minute'
          FROM generate_series(1, 5000) AS g""",
    "inbox_watermarks": """
        INSERT INTO pgonce.inbox_watermarks (source, ordering_key, version, event_id, updated_at)
        SELECT 's', g::text, 1, g::text, now() FROM generate_series(1, 100) AS g""",
    "outbox_waiting_relays": """
        INSERT INTO pgonce.outbox_waiting_relays (relay, since)
        SELECT g::text, now() FROM generate_series(1, 100) AS g""",
    "inbox_waiting_workers": """
        INSERT INTO pgonce.inbox_waiting_workers (worker, since)
        SELECT g::text, now() FROM generate_series(1, 100) AS g""",
    "key_leases": """
        INSERT INTO pgonce.key_leases (scope, key, token, locked_until, operation, args, state,
                                       attempts)
        SELECT 's', g::text, g, now() + (g - 100) * interval '1 second', 'pay', '{}', '{}', 1
          FROM generate_series(1, 5000) AS g""",
    "sweep_marks": """
        INSERT INTO pgonce.sweep_marks (target, scope, deleted, newest, swept_at)
        SELECT 'keys', g::text, 1, now(), now() FROM generate_series(1, 100) AS g""",
}

RELAY_CLAIM = {"now": None, "limit": 100, "per_aggregate": 10}

# table -> index -> (queries file, statement, parameters): the statement each index exists for.
READERS: dict[str, dict[str, tuple[str, str, dict[str, Any]]]] = {
    "keys": {
        "keys_pkey": ("keys", "claim_read", {"scope": "s", "key": "k"}),
        # And every other statement of KEYS_BY_COMPLETION below.
        "keys_by_completion": ("sweep", "delete_keys", SWEEP),
    },
    "inbox": {
        "inbox_pkey": ("inbox", "get", {"source": "github", "event_id": "7"}),
        "inbox_pending": (
            "inbox",
            "claim",
            {"now": None, "source": "github", "blocking": True, "limit": 10},
        ),
        "inbox_ordering": (
            "inbox",
            "claim",
            {"now": None, "source": "github", "blocking": True, "limit": 10},
        ),
        "inbox_finished_by_age": ("sweep", "delete_inbox", SWEEP),
        "inbox_dead": ("inbox", "replay", {"now": None, "source": "github", "event_ids": None}),
    },
    "inbox_watermarks": {
        "inbox_watermarks_pkey": (
            "inbox",
            "advance_watermark",
            {"source": "s", "ordering_key": "k", "version": 2, "event_id": "e", "now": None},
        ),
    },
    "outbox": {
        "outbox_pkey": ("outbox", "mark_published", {"now": None, "ids": [1, 2]}),
        "outbox_pending": ("outbox", "claim", RELAY_CLAIM),
        "outbox_pending_aggregate": ("outbox", "claim", RELAY_CLAIM),
        "outbox_published_at": ("sweep", "delete_outbox", SWEEP),
        "outbox_parked": ("outbox", "replay", {"now": None, "ids": None, "aggregatetype": None}),
    },
    "outbox_aggregates": {
        "outbox_aggregates_pkey": ("sweep", "delete_outbox_aggregates", SWEEP),
        "outbox_aggregates_by_age": ("sweep", "delete_outbox_aggregates", SWEEP),
    },
    "outbox_waiting_relays": {
        "outbox_waiting_relays_pkey": ("outbox", "unregister_waiting", {"relay": "r"}),
    },
    "inbox_waiting_workers": {
        "inbox_waiting_workers_pkey": ("inbox", "unregister_waiting", {"worker": "w"}),
    },
    "key_leases": {
        "key_leases_pkey": (
            "phases",
            "renew",
            {"scope": "s", "key": "k", "token": 1, "now": None, "lease": timedelta(seconds=30)},
        ),
        # The completer's search for expired leases.
        "key_leases_expired": (
            "phases",
            "abandoned",
            {"now": None, "limit": 100, "operations": ["pay"], "max_age": timedelta(hours=1)},
        ),
    },
    "sweep_marks": {
        # The upsert of every sweep batch; health reads one target's few rows.
        "sweep_marks_pkey": ("sweep", "delete_keys", SWEEP),
    },
}


def _plan_nodes(
    conn: psycopg.Connection[Any], statement: bytes, params: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """Every node of the statement's plan, subplans included."""
    plan = conn.execute(b"EXPLAIN (FORMAT JSON) " + statement, params).fetchone()
    assert plan is not None
    pending = [plan[0][0]["Plan"]]
    while pending:
        node = pending.pop()
        yield node
        pending.extend(node.get("Plans", ()))


def _indexes_read(
    conn: psycopg.Connection[Any], statement: bytes, params: dict[str, Any]
) -> set[str]:
    found: set[str] = set()
    for node in _plan_nodes(conn, statement, params):
        if "Index Name" in node:
            found.add(node["Index Name"])
        found.update(node.get("Conflict Arbiter Indexes", ()))  # an upsert's conflict check
    return found


@pytest.mark.parametrize("table", sorted(READERS))
def test_each_index_has_its_reader_and_there_is_no_other(dsn: str, table: str) -> None:
    readers = READERS[table]
    with psycopg.connect(dsn) as conn:
        conn.execute(FILL[table].encode())
        conn.execute(f"ANALYZE pgonce.{table}".encode())
        conn.execute("SET LOCAL enable_seqscan = off")
        existing = {
            row[0]
            for row in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = 'pgonce' AND tablename = %s",
                (table,),
            )
        }
        assert existing == set(readers), "an index without a reader here, or a reader without one"
        for index, (group, name, params) in readers.items():
            statement = getattr(pgsql.Queries(group, "pgonce"), name)
            assert index in _indexes_read(conn, statement, params), f"{group}.{name}"


STUCK = {"now": None, "stuck_after": timedelta(minutes=5)}

# The statements keys_by_completion serves: both sweep paths and the retention figures by its
# non-NULL values in age order, the stuck claims (and their listing) by its NULLs.
KEYS_BY_COMPLETION: dict[str, tuple[str, str, dict[str, Any]]] = {
    "delete_keys": ("sweep", "delete_keys", SWEEP),
    "delete_keys_by_ctid": ("sweep", "delete_keys_by_ctid", SWEEP),
    "horizon_keys": ("health", "horizon_keys", SWEEP),
    "stuck_keys": ("health", "stuck_keys", STUCK),
    "stuck_claims": ("inspect", "stuck_claims", {"now": None, "older_than": DAY, "limit": 50}),
}


@pytest.mark.parametrize("reader", sorted(KEYS_BY_COMPLETION))
def test_the_keys_statements_read_a_range_of_keys_by_completion(dsn: str, reader: str) -> None:
    group, name, params = KEYS_BY_COMPLETION[reader]
    with psycopg.connect(dsn) as conn:
        conn.execute(FILL["keys"].encode())
        conn.execute("ANALYZE pgonce.keys")
        conn.execute("SET LOCAL enable_seqscan = off")
        statement = getattr(pgsql.Queries(group, "pgonce"), name)
        nodes = [
            node
            for node in _plan_nodes(conn, statement, params)
            if node.get("Relation Name") == "keys"
        ]
        ranges = [node for node in nodes if node.get("Index Name") == "keys_by_completion"]
        assert ranges, nodes
        # A range of the index (an Index Cond on completed_at), never the whole index.
        assert all("completed_at" in node.get("Index Cond", "") for node in ranges), ranges
        assert all(node["Node Type"] != "Seq Scan" for node in nodes), nodes


def test_every_table_of_the_schema_is_covered(dsn: str) -> None:
    # schema_migrations' primary key is the ledger's one-row-per-version rule, read by migrate.
    with psycopg.connect(dsn) as conn:
        tables = {
            row[0]
            for row in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'pgonce'")
        }
    assert tables - {"schema_migrations"} == set(READERS)


def test_the_idle_aggregates_sweep_probes_the_outbox_and_never_scans_it(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(FILL["outbox"].encode())
        conn.execute(FILL["outbox_aggregates"].encode())
        conn.execute("ANALYZE pgonce.outbox")
        conn.execute("ANALYZE pgonce.outbox_aggregates")
        statement = pgsql.Queries("sweep", "pgonce").delete_outbox_aggregates
        scans = [
            (node["Node Type"], node.get("Index Name", ""))
            for node in _plan_nodes(conn, statement, SWEEP)
            if node.get("Relation Name") == "outbox"
        ]
        # No "SET enable_seqscan = off" here: the planner's own choice on a realistic outbox.
        assert {index for _, index in scans} == {"outbox_pending_aggregate", "outbox_parked"}
        assert all(kind != "Seq Scan" for kind, _ in scans), scans


# A retention's worth of handled rows and a small backlog: 100,000 rows, 0.3 % pending, 0.1 % dead;
# of keys, 100,000 with 0.1 % never completed.
RETAINED = {
    "keys": """
        INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at)
        SELECT 's', g::text, sha256(g::text::bytea), now() - g * interval '1 second',
               CASE WHEN g % 1000 <> 0 THEN now() - g * interval '1 second' END
          FROM generate_series(1, 100000) AS g""",
    "inbox": """
        INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, received_at, status,
                                  next_attempt_at, processed_at)
        SELECT 'github', g::text, '{}', '{}', sha256(g::text::bytea),
               now() - g * interval '1 second', s.status, now(),
               CASE WHEN s.status = 'pending' THEN NULL ELSE now() END
          FROM generate_series(1, 100000) AS g,
               LATERAL (SELECT CASE WHEN g % 1000 < 3 THEN 'pending'
                                    WHEN g % 1000 = 3 THEN 'dead' ELSE 'done' END) AS s(status)""",
    "outbox": """
        INSERT INTO pgonce.outbox (aggregatetype, aggregateid, type, payload, created_at,
                                   published_at, parked_at, next_attempt_at)
        SELECT 'order', (g % 5000)::text, 'order.created', '{}', now(),
               CASE WHEN g % 1000 > 3 THEN now() END,
               CASE WHEN g % 1000 = 3 THEN now() END, now()
          FROM generate_series(1, 100000) AS g""",
}


@pytest.mark.parametrize(
    ("table", "group", "name", "indexes", "params"),
    [
        ("inbox", "inspect", "inbox_backlog", {"inbox_pending", "inbox_dead"}, {"now": None}),
        ("outbox", "outbox", "backlog", {"outbox_pending", "outbox_parked"}, {"now": None}),
        # The stuck claims: keys_by_completion's NULLs, never its completed keys.
        ("keys", "health", "stuck_keys", {"keys_by_completion"}, STUCK),
    ],
)
def test_the_metrics_read_the_backlog_and_never_the_retained_rows(
    dsn: str, table: str, group: str, name: str, indexes: set[str], params: dict[str, Any]
) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(RETAINED[table].encode())
        conn.execute(f"ANALYZE pgonce.{table}".encode())
        statement = getattr(pgsql.Queries(group, "pgonce"), name)
        nodes = list(_plan_nodes(conn, statement, params))
        # The planner's own choice (sequential scans not priced out): every scrape runs this.
        assert {node["Index Name"] for node in nodes if "Index Name" in node} == indexes
        scans = [node["Node Type"] for node in nodes if node.get("Relation Name") == table]
        assert scans, "the statement reads no table"
        assert "Seq Scan" not in scans, scans
        # An index that also holds the retained rows is read by a range of the backlog's alone.
        unfiltered = [n for n in nodes if n.get("Index Name") == "keys_by_completion"]
        assert all("IS NULL" in n.get("Index Cond", "") for n in unfiltered), unfiltered


# A completion that changes no column an index reads, and whose new version fits on the row's
# page, is a HOT update: no index entry, a smaller WAL record (0013). Responses of 1 KB: on pages
# filled to the brim (fillfactor 100) the longer new version often no longer fits.
BODY = b'{"pad": "' + b"x" * 1000 + b'"}'


def _updates(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(updates, HOT updates) of pgonce.keys so far, this connection's included."""
    conn.execute("SELECT pg_stat_force_next_flush()")  # flushed when the session goes idle
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
        " WHERE relid = 'pgonce.keys'::regclass"
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def _complete(conn: psycopg.Connection[Any], path: str, key: str) -> None:
    from pgonce import KeyStore, Response, Won

    store, response = KeyStore(), Response(201, body=BODY)
    if path == "once":
        with conn.transaction(), store.once(conn, "s", key, bytes(32)) as op:
            op.respond(response)
    elif path == "once(commit=True)":
        with store.once(conn, "s", key, bytes(32), commit=True) as op:
            op.respond(response)
    elif path == "begin":
        claim = store.begin(conn, "s", key, bytes(32))
        assert store.commit(conn, claim, response)
    else:  # a bare claim(): completed_at is set by its completion
        with conn.transaction():
            claim = store.claim(conn, "s", key, bytes(32))
            assert isinstance(claim, Won)
            assert store.complete(conn, claim, response)


@pytest.mark.parametrize("path", ["once", "once(commit=True)", "begin"])
def test_the_completions_of_once_and_begin_are_hot_updates(dsn: str, path: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = _updates(conn)
        for i in range(60):  # several pages' worth
            _complete(conn, path, f"k{i}")
        after = _updates(conn)
    assert (after[0] - before[0], after[1] - before[1]) == (60, 60)


def test_a_bare_claims_completion_is_not_a_hot_update(dsn: str) -> None:
    # A bare claim() is born with completed_at NULL, among keys_by_completion's NULLs, for the
    # stuck-claims check (its caller may commit it without a response); its completion sets
    # completed_at, a new keys_by_completion entry, which no HOT update can write.
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = _updates(conn)
        _complete(conn, "claim", "k")
        after = _updates(conn)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)


def test_a_bare_claim_committed_without_a_response_is_still_a_stuck_claim(dsn: str) -> None:
    # What keys_by_completion's NULLs are for: the born-completed claims of once() and begin()
    # cannot be committed without their response, a bare claim()'s can.
    from datetime import UTC, datetime

    from pgonce import KeyStore, Won
    from pgonce.store._sync.health import HealthCheck

    store, hour_ago = KeyStore(), datetime.now(UTC) - timedelta(hours=1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            assert isinstance(store.claim(conn, "s", "bare", bytes(32), now=hour_ago), Won)
        with conn.transaction(), store.once(conn, "s", "once", bytes(32), now=hour_ago) as op:
            assert op.won  # completed with no response when the block ends
        report = HealthCheck(targets=["keys"]).check(conn)
    found = [f for f in report.findings if f.check == "stuck claims"]
    assert [(f.status, f.value.split(" ")[0]) for f in found] == [("fail", "1")]


# The console's reads (queries/console.sql): each statement, on a filled table with sequential
# scans priced out, reads the index it is written for, and no statement is left unlisted.
FAR = "9999-01-01T00:00:00+00:00"
EVENTS = {"source": None, "status": None, "after_at": FAR, "after_source": "", "after_id": ""}
OUTBOX_PAGE = {"after_id": 2**62, "aggregatetype": None, "aggregateid": None, "limit": 50}
CHART = {"since": "2000-01-01T00:00:00+00:00", "step_s": 60.0, "span": timedelta(hours=1)}
CONSOLE: dict[str, tuple[str, set[str], dict[str, Any]]] = {
    "keys_page": (
        "keys",
        {"keys_pkey"},
        {"scope": "s", "prefix": "12", "after": "", "limit": 50},
    ),
    "key_detail": ("keys", {"keys_pkey"}, {"scope": "s", "key": "12"}),
    "events_dead": ("inbox", {"inbox_dead"}, {**EVENTS, "limit": 50}),
    "events_pending": ("inbox", {"inbox_pending"}, {**EVENTS, "limit": 50}),
    "events_finished": ("inbox", {"inbox_finished_by_age"}, {**EVENTS, "limit": 50}),
    "event_by_id": ("inbox", {"inbox_pkey"}, {"sources": ["github", "x"], "event_id": "7"}),
    "outbox_page": ("outbox", {"outbox_pkey"}, {**OUTBOX_PAGE, "published": False}),
    "outbox_page_pending": ("outbox", {"outbox_pending"}, OUTBOX_PAGE),
    "outbox_page_parked": ("outbox", {"outbox_parked"}, OUTBOX_PAGE),
    "outbox_detail": ("outbox", {"outbox_pkey"}, {"id": 7}),
    "outbox_counts_by_type": ("outbox", {"outbox_parked"}, {}),
    "chart_keys": ("keys", {"keys_by_completion"}, CHART),
    "chart_inbox": (
        "inbox",
        {"inbox_finished_by_age", "inbox_pending", "inbox_dead"},
        CHART,
    ),
    "chart_inbox_backlog": (
        "inbox",
        {"inbox_finished_by_age", "inbox_pending", "inbox_dead"},
        CHART,
    ),
    "chart_outbox": ("outbox", {"outbox_published_at"}, CHART),
    "chart_outbox_backlog": ("outbox", {"outbox_published_at", "outbox_pending"}, CHART),
    "sweep_marks": ("sweep_marks", {"sweep_marks_pkey"}, {}),
}


def test_every_console_statement_is_held_to_an_index() -> None:
    assert set(pgsql.parse_named(pgsql._read("queries", "console.sql"))) == set(CONSOLE)


@pytest.mark.parametrize("name", sorted(CONSOLE))
def test_the_console_reads_index_ranges(dsn: str, name: str) -> None:
    table, indexes, params = CONSOLE[name]
    with psycopg.connect(dsn) as conn:
        conn.execute(FILL[table].encode())
        conn.execute(f"ANALYZE pgonce.{table}".encode())
        conn.execute("SET LOCAL enable_seqscan = off")
        statement = getattr(pgsql.Queries("console", "pgonce"), name)
        nodes = list(_plan_nodes(conn, statement, params))
        assert indexes <= _indexes_read(conn, statement, params), name
        scans = [n["Node Type"] for n in nodes if n.get("Relation Name") == table]
        assert "Seq Scan" not in scans, (name, scans)
