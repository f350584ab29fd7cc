-- Sweeper statements. {schema} is pgonce's schema, composed with psycopg.sql.Identifier.
--
-- Each sweep target (pgonce.core.retention.TARGETS) has ONE statement here, `delete_<target>`,
-- that deletes ONE bounded batch. It alone decides which rows are deletable. Parameters, from
-- RetentionPolicy.params():
--   now           timestamptz, or NULL for the server's clock (tests set it)
--   default_keep  interval: the retention of every scope without its own
--   scopes, keeps text[] and interval[] of the same length: scopes with their own retention
--   min_keep      interval: the shortest retention of all, an index-friendly bound on the age
--   batch_size    integer
--
-- How every delete_<target> is built, and why:
--   * The batch is chosen with LIMIT ... FOR UPDATE SKIP LOCKED: concurrent sweepers take disjoint
--     rows, never wait for each other or for a transaction holding a row, and never delete a row
--     twice (a row deleted by another sweeper after our snapshot is skipped, not counted).
--   * The DELETE joins the chosen rows on the primary key, scope first: no ctid, so the statement
--     is correct on Citus, where scope is the distribution column. On plain PostgreSQL an optional
--     twin, `delete_<target>_by_ctid`, joins on ctid instead (a TID scan, ~1.5 times the rows/s): the
--     rows are locked by this very statement, so their ctid cannot change before the DELETE. The
--     twin must be the same statement but for its last line (tests/test_sweeper.py checks it).
--   * Oldest first (ORDER BY the age column, with an index on it, partial to deletable rows): a
--     batch costs the rows it deletes, not the table, and a capped run leaves the youngest behind.
--   * The sweeper runs each batch in its own transaction, under its own `statement_timeout`.
--   * The same statement notes what it deleted in sweep_marks (CTE `noted`: per scope, the rows
--     deleted and the newest age-column value among them), from `doomed`: the rows it locked are
--     exactly the rows it deletes. Health reads the note to tell a young table from a sweeper that
--     deletes rows its senders may still retry (migration 0015). One row per target and scope,
--     written in scope order, so two batches touching the same scopes queue, never deadlock.
--   * A table without scopes (the outbox) uses %(default_keep)s alone; unused parameters are fine.
--
-- Registering another table is one statement in this shape, e.g. for the inbox:
--   -- name: delete_inbox
--   WITH doomed AS MATERIALIZED (
--       SELECT i.source, i.event_id FROM {schema}.inbox AS i
--         LEFT JOIN unnest(...) AS p(scope, keep) ON p.scope = i.source
--        WHERE i.status IN ('done', 'skipped') AND i.received_at < ... (as below)
--        ORDER BY i.received_at LIMIT %(batch_size)s FOR UPDATE OF i SKIP LOCKED)
--   DELETE FROM {schema}.inbox AS i USING doomed
--    WHERE i.source = doomed.source AND i.event_id = doomed.event_id

-- name: statement_timeout
-- SET LOCAL, parameterized: it ends with the transaction, so pooled connections keep no state.
SELECT set_config('statement_timeout', %(timeout_ms)s, true)

-- name: plain_postgres
-- Whether ctid may be used: not where Citus distributes the tables.
SELECT NOT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'citus')

-- name: delete_keys
-- Completed keys only: a claim in flight is never deleted, however old (a claim() committed
-- without its response has completed_at NULL, which no bound is greater than; a begin() claim is
-- invisible until it commits with its response).
-- completed_at ages a key: its retention runs from the stored answer. For a claim of begin() or
-- once(), born completed, that is its claim time, from which a provider's retry horizon runs; a
-- bare claim() or a two-phase request answered later is kept longer by as much. Oldest first,
-- through keys_by_completion: a batch reads the rows it deletes, not the table.
-- A completed key keeps a lease row (key_leases) only when the completer retired its two-phase
-- request (the record health counts): it goes with the key, so that the key can be claimed again.
WITH doomed AS MATERIALIZED (
    SELECT k.ctid, k.scope, k.key, k.completed_at
      FROM {schema}.keys AS k
      LEFT JOIN unnest(%(scopes)s::text[], %(keeps)s::interval[]) AS p(scope, keep)
             ON p.scope = k.scope
     WHERE k.completed_at < coalesce(%(now)s::timestamptz, now()) - %(min_keep)s::interval
       AND k.completed_at < coalesce(%(now)s::timestamptz, now())
                            - coalesce(p.keep, %(default_keep)s::interval)
     ORDER BY k.completed_at
     LIMIT %(batch_size)s
       FOR UPDATE OF k SKIP LOCKED
),
noted AS (
    INSERT INTO {schema}.sweep_marks AS m (target, scope, deleted, newest, swept_at)
    SELECT 'keys', d.scope, count(*), max(d.completed_at), coalesce(%(now)s::timestamptz, now())
      FROM doomed AS d
     GROUP BY 2
     ORDER BY 2
    ON CONFLICT (target, scope) DO UPDATE
       SET deleted = m.deleted + excluded.deleted,
           newest = greatest(m.newest, excluded.newest),
           swept_at = greatest(m.swept_at, excluded.swept_at)
),
released AS (
    DELETE FROM {schema}.key_leases AS l
     USING doomed
     WHERE l.scope = doomed.scope AND l.key = doomed.key
)
DELETE FROM {schema}.keys AS k
 USING doomed
 WHERE k.scope = doomed.scope AND k.key = doomed.key

-- name: delete_keys_by_ctid
-- delete_keys, joined on ctid: plain PostgreSQL only (see the header).
WITH doomed AS MATERIALIZED (
    SELECT k.ctid, k.scope, k.key, k.completed_at
      FROM {schema}.keys AS k
      LEFT JOIN unnest(%(scopes)s::text[], %(keeps)s::interval[]) AS p(scope, keep)
             ON p.scope = k.scope
     WHERE k.completed_at < coalesce(%(now)s::timestamptz, now()) - %(min_keep)s::interval
       AND k.completed_at < coalesce(%(now)s::timestamptz, now())
                            - coalesce(p.keep, %(default_keep)s::interval)
     ORDER BY k.completed_at
     LIMIT %(batch_size)s
       FOR UPDATE OF k SKIP LOCKED
),
noted AS (
    INSERT INTO {schema}.sweep_marks AS m (target, scope, deleted, newest, swept_at)
    SELECT 'keys', d.scope, count(*), max(d.completed_at), coalesce(%(now)s::timestamptz, now())
      FROM doomed AS d
     GROUP BY 2
     ORDER BY 2
    ON CONFLICT (target, scope) DO UPDATE
       SET deleted = m.deleted + excluded.deleted,
           newest = greatest(m.newest, excluded.newest),
           swept_at = greatest(m.swept_at, excluded.swept_at)
),
released AS (
    DELETE FROM {schema}.key_leases AS l
     USING doomed
     WHERE l.scope = doomed.scope AND l.key = doomed.key
)
DELETE FROM {schema}.keys AS k
 USING doomed
 WHERE k.ctid = doomed.ctid

-- name: delete_inbox
-- Handled deliveries only (done, skipped): pending events and dead letters are never deleted.
-- received_at ages a delivery: the provider's retry horizon runs from its first delivery, and a
-- redelivery after the row is gone would be stored and handled again. Retention per source.
WITH doomed AS MATERIALIZED (
    SELECT i.ctid, i.source, i.event_id, i.received_at
      FROM {schema}.inbox AS i
      LEFT JOIN unnest(%(scopes)s::text[], %(keeps)s::interval[]) AS p(scope, keep)
             ON p.scope = i.source
     WHERE i.status IN ('done', 'skipped')
       AND i.received_at < coalesce(%(now)s::timestamptz, now()) - %(min_keep)s::interval
       AND i.received_at < coalesce(%(now)s::timestamptz, now())
                           - coalesce(p.keep, %(default_keep)s::interval)
     ORDER BY i.received_at
     LIMIT %(batch_size)s
       FOR UPDATE OF i SKIP LOCKED
),
noted AS (
    INSERT INTO {schema}.sweep_marks AS m (target, scope, deleted, newest, swept_at)
    SELECT 'inbox', d.source, count(*), max(d.received_at), coalesce(%(now)s::timestamptz, now())
      FROM doomed AS d
     GROUP BY 2
     ORDER BY 2
    ON CONFLICT (target, scope) DO UPDATE
       SET deleted = m.deleted + excluded.deleted,
           newest = greatest(m.newest, excluded.newest),
           swept_at = greatest(m.swept_at, excluded.swept_at)
)
DELETE FROM {schema}.inbox AS i
 USING doomed
 WHERE i.source = doomed.source AND i.event_id = doomed.event_id

-- name: delete_outbox
-- Published rows only: a row still waiting for the broker, or parked, is never deleted. The outbox
-- has no scope: %(default_keep)s alone, aged by published_at (through outbox_published_at).
WITH doomed AS MATERIALIZED (
    SELECT o.id, o.published_at
      FROM {schema}.outbox AS o
     WHERE o.published_at IS NOT NULL
       AND o.published_at < coalesce(%(now)s::timestamptz, now()) - %(default_keep)s::interval
     ORDER BY o.published_at
     LIMIT %(batch_size)s
       FOR UPDATE OF o SKIP LOCKED
),
noted AS (
    INSERT INTO {schema}.sweep_marks AS m (target, scope, deleted, newest, swept_at)
    SELECT 'outbox', ''::text, count(*), max(d.published_at), coalesce(%(now)s::timestamptz, now())
      FROM doomed AS d
     GROUP BY 2
     ORDER BY 2
    ON CONFLICT (target, scope) DO UPDATE
       SET deleted = m.deleted + excluded.deleted,
           newest = greatest(m.newest, excluded.newest),
           swept_at = greatest(m.swept_at, excluded.swept_at)
)
DELETE FROM {schema}.outbox AS o
 USING doomed
 WHERE o.id = doomed.id

-- name: delete_outbox_aggregates
-- The lock rows of aggregates that enqueued nothing for the retention and have no row left to
-- publish. An enqueue holding the row is skipped; one arriving after the delete recreates it.
-- "No row left to publish" is asked twice, pending rows and parked ones, so that each question
-- is a probe of a partial index by aggregate (outbox_pending_aggregate, outbox_parked): asked
-- once, as `published_at IS NULL`, it matched neither, and every batch read the whole outbox,
-- published rows of the whole retention included (19 ms at 200,000 rows, growing with it).
-- The parked question keeps OFFSET 0, which makes it a probe per aggregate rather than a join:
-- the planner, multiplying the two columns' NULL fractions as if unrelated, expects a few dozen
-- dead letters and would read them all for every aggregate (1,000,000 comparisons, 83 ms, a
-- batch of 500 against 2,000 dead letters; 500 probes instead).
WITH doomed AS MATERIALIZED (
    SELECT a.aggregatetype, a.aggregateid, a.last_enqueued_at
      FROM {schema}.outbox_aggregates AS a
     WHERE a.last_enqueued_at < coalesce(%(now)s::timestamptz, now()) - %(default_keep)s::interval
       AND NOT EXISTS (
           SELECT 1 FROM {schema}.outbox AS o
            WHERE o.aggregatetype = a.aggregatetype AND o.aggregateid = a.aggregateid
              AND o.published_at IS NULL AND o.parked_at IS NULL)
       AND NOT EXISTS (
           SELECT 1 FROM {schema}.outbox AS o
            WHERE o.aggregatetype = a.aggregatetype AND o.aggregateid = a.aggregateid
              AND o.parked_at IS NOT NULL AND o.published_at IS NULL
           OFFSET 0)
     ORDER BY a.last_enqueued_at
     LIMIT %(batch_size)s
       FOR UPDATE OF a SKIP LOCKED
),
noted AS (
    INSERT INTO {schema}.sweep_marks AS m (target, scope, deleted, newest, swept_at)
    SELECT 'outbox_aggregates', ''::text, count(*), max(d.last_enqueued_at), coalesce(%(now)s::timestamptz, now())
      FROM doomed AS d
     GROUP BY 2
     ORDER BY 2
    ON CONFLICT (target, scope) DO UPDATE
       SET deleted = m.deleted + excluded.deleted,
           newest = greatest(m.newest, excluded.newest),
           swept_at = greatest(m.swept_at, excluded.swept_at)
)
DELETE FROM {schema}.outbox_aggregates AS a
 USING doomed
 WHERE a.aggregatetype = doomed.aggregatetype AND a.aggregateid = doomed.aggregateid
