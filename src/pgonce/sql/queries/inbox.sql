-- Webhook inbox statements. {schema} is pgonce's schema, composed with psycopg.sql.Identifier.

-- name: store
-- A batch of deliveries in one statement; see inbox_store() in schema.sql for the outcomes.
SELECT ord, outcome
  FROM {schema}.inbox_store(%(sources)s::text[], %(event_ids)s::text[], %(bodies)s::bytea[],
                            %(headers)s::jsonb[], %(digests)s::bytea[], %(ordering_keys)s::text[],
                            %(versions)s::bigint[], %(now)s, %(channel)s)

-- name: claim
-- Pending, due events of the given sources. An event with an ordering key is taken only when it is
-- the head of its key: no earlier event of that key is still pending (being processed by another
-- worker counts: its row is pending until that worker commits) or, for the sources listed in
-- `blocking`, dead. SKIP LOCKED lets workers claim side by side without waiting on each other.
SELECT i.source, i.event_id, i.body, i.headers, i.attempts, i.received_at, i.ordering_key,
       i.version
  FROM {schema}.inbox AS i
 WHERE i.status = 'pending'
   AND i.source = ANY(%(sources)s::text[])
   AND i.next_attempt_at <= coalesce(%(now)s::timestamptz, now())
   AND (i.ordering_key IS NULL OR NOT EXISTS (
        SELECT 1
          FROM {schema}.inbox AS h
         WHERE h.source = i.source
           AND h.ordering_key = i.ordering_key
           AND h.status IN ('pending', 'dead')
           AND (h.received_at, h.seq) < (i.received_at, i.seq)
           AND (h.status = 'pending' OR h.source = ANY(%(blocking)s::text[]))))
 ORDER BY i.next_attempt_at
 LIMIT %(limit)s
   FOR UPDATE OF i SKIP LOCKED

-- name: savepoint
SAVEPOINT pgonce_inbox_event

-- name: release_savepoint
RELEASE SAVEPOINT pgonce_inbox_event

-- name: next_savepoint
-- Two statements in one round trip (no parameters: the simple query protocol carries both).
RELEASE SAVEPOINT pgonce_inbox_event; SAVEPOINT pgonce_inbox_event

-- name: rollback_savepoint
ROLLBACK TO SAVEPOINT pgonce_inbox_event

-- name: finish
-- Events whose handler succeeded ('done') or that were dropped as out of order ('skipped'), in
-- the transaction that ran their handlers.
UPDATE {schema}.inbox AS i
   SET status = f.status,
       attempts = i.attempts + f.ran,
       processed_at = coalesce(%(now)s::timestamptz, now())
  FROM unnest(%(sources)s::text[], %(event_ids)s::text[], %(statuses)s::text[], %(ran)s::integer[])
       AS f(source, event_id, status, ran)
 WHERE i.source = f.source AND i.event_id = f.event_id AND i.status = 'pending'

-- name: fail
-- A handler failure: retry at next_attempt_at, or dead-letter (status 'dead').
UPDATE {schema}.inbox
   SET attempts = attempts + 1,
       status = %(status)s,
       next_attempt_at = coalesce(%(next_attempt_at)s, next_attempt_at),
       last_error = %(error)s,
       processed_at = CASE WHEN %(status)s = 'dead' THEN coalesce(%(now)s::timestamptz, now()) END
 WHERE source = %(source)s AND event_id = %(event_id)s AND status = 'pending'

-- name: advance_watermark
-- Moves the watermark of (source, ordering key) to `version` unless it is already past it; no row
-- returned means the event is older than what was applied: the out-of-order policy drops it.
INSERT INTO {schema}.inbox_watermarks AS w (source, ordering_key, version, event_id, updated_at)
VALUES (%(source)s, %(ordering_key)s, %(version)s, %(event_id)s,
        coalesce(%(now)s::timestamptz, now()))
    ON CONFLICT (source, ordering_key) DO UPDATE
   SET version = excluded.version, event_id = excluded.event_id, updated_at = excluded.updated_at
 WHERE w.version <= excluded.version
RETURNING w.version

-- name: replay
-- Dead letters back to pending with a fresh retry budget; the last error stays for the record.
UPDATE {schema}.inbox
   SET status = 'pending',
       attempts = 0,
       next_attempt_at = coalesce(%(now)s::timestamptz, now()),
       processed_at = NULL
 WHERE source = %(source)s
   AND status = 'dead'
   AND (%(event_ids)s::text[] IS NULL OR event_id = ANY(%(event_ids)s::text[]))
RETURNING event_id

-- name: notify
SELECT pg_notify(%(channel)s, '')

-- name: get
SELECT source, event_id, status, attempts, received_at, next_attempt_at, last_error,
       ordering_key, version, processed_at
  FROM {schema}.inbox
 WHERE source = %(source)s AND event_id = %(event_id)s

-- name: counts
SELECT source, status, count(*)
  FROM {schema}.inbox
 GROUP BY source, status
 ORDER BY source, status
