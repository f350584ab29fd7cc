-- Read-only statements for people: the admin page, `pgonce events`, and the service's metrics.
-- {schema} is pgonce's schema. Nothing here writes.

-- name: inbox_overview
-- Per source and status: how many events, and the oldest one (for "oldest pending" ages).
SELECT source, status, count(*) AS events, min(received_at) AS oldest
  FROM {schema}.inbox
 GROUP BY source, status
 ORDER BY source, status

-- name: inbox_backlog
-- Per source: pending events with the oldest one (queue lag), and dead letters. The metrics run it
-- at every scrape, so it reads the two partial indexes (inbox_pending, inbox_dead), never the
-- handled events of the retention, which inbox_overview counts for a person who asks.
SELECT source, 'pending' AS status, count(*) AS events, min(received_at) AS oldest
  FROM {schema}.inbox
 WHERE status = 'pending'
 GROUP BY source
UNION ALL
SELECT source, 'dead', count(*), min(received_at)
  FROM {schema}.inbox
 WHERE status = 'dead'
 GROUP BY source
 ORDER BY 1, 2

-- name: table_estimates
-- Rows in pgonce's tables as PostgreSQL estimates them (pg_class.reltuples, which VACUUM, ANALYZE
-- and autovacuum keep): the retention's size without counting it. -1 until the table was first
-- vacuumed or analyzed (PostgreSQL 14 and later: "unknown").
SELECT c.relname::text, c.reltuples::bigint
  FROM pg_class AS c
 WHERE c.relnamespace = (SELECT n.oid FROM pg_namespace AS n WHERE n.nspname = %(schema)s)
   AND c.relname IN ('keys', 'inbox', 'outbox')
 ORDER BY 1

-- name: list_events
-- Newest first; every filter is optional (NULL means "any").
SELECT source, event_id, status, attempts, received_at, next_attempt_at, processed_at,
       left(last_error, 300) AS last_error, octet_length(body) AS bytes
  FROM {schema}.inbox
 WHERE (%(source)s::text IS NULL OR source = %(source)s)
   AND (%(status)s::text IS NULL OR status = %(status)s)
   AND (%(event_id)s::text IS NULL OR event_id = %(event_id)s)
 ORDER BY received_at DESC, seq DESC
 LIMIT %(limit)s

-- name: event_detail
-- The columns of list_events first (without truncating the error), then the detail.
SELECT source, event_id, status, attempts, received_at, next_attempt_at, processed_at,
       last_error, octet_length(body) AS bytes,
       ordering_key, version, headers, body, encode(digest, 'hex') AS digest
  FROM {schema}.inbox
 WHERE source = %(source)s AND event_id = %(event_id)s

-- name: stuck_claims
-- Claims in flight for longer than %(older_than)s: the rows the health check counts, by name
-- (keys_by_completion's NULLs, sorted).
SELECT scope, key, claimed_at
  FROM {schema}.keys
 WHERE completed_at IS NULL
   AND claimed_at < coalesce(%(now)s::timestamptz, now()) - %(older_than)s::interval
 ORDER BY claimed_at
 LIMIT %(limit)s

-- name: schema_version
-- What /readyz compares with the latest migration this code knows.
SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations

-- name: troubles
-- What failed and waits for a person or a retry, for `pgonce doctor`: outbox rows the broker
-- refused (waiting out a backoff, or parked) by aggregate type, and inbox events whose handler
-- failed (retrying, or dead) by source; each group with its count, its next attempt and the
-- newest failure's reason. Each branch matches a partial index (outbox_pending, outbox_parked,
-- inbox_pending, inbox_dead), so the retained published rows and handled events are never read.
SELECT 'outbox' AS part, aggregatetype AS name, 'waiting' AS state, count(*) AS rows,
       min(next_attempt_at) AS next_attempt_at,
       (array_agg(left(last_error, 300) ORDER BY next_attempt_at DESC))[1] AS last_error
  FROM {schema}.outbox
 WHERE published_at IS NULL AND parked_at IS NULL AND attempts > 0
 GROUP BY aggregatetype
UNION ALL
SELECT 'outbox', aggregatetype, 'parked', count(*), NULL,
       (array_agg(left(last_error, 300) ORDER BY parked_at DESC))[1]
  FROM {schema}.outbox
 WHERE parked_at IS NOT NULL AND published_at IS NULL
 GROUP BY aggregatetype
UNION ALL
SELECT 'inbox', source, 'retrying', count(*), min(next_attempt_at),
       (array_agg(left(last_error, 300) ORDER BY next_attempt_at DESC))[1]
  FROM {schema}.inbox
 WHERE status = 'pending' AND attempts > 0
 GROUP BY source
UNION ALL
SELECT 'inbox', source, 'dead', count(*), NULL,
       (array_agg(left(last_error, 300) ORDER BY processed_at DESC NULLS LAST))[1]
  FROM {schema}.inbox
 WHERE status = 'dead'
 GROUP BY source
 ORDER BY 1 DESC, 2, 3
