-- Webhook inbox statements. {schema} is pgonce's schema, composed with psycopg.sql.Identifier.

-- name: store
-- A batch of deliveries in one statement; see inbox_store() in schema.sql for the outcomes.
SELECT ord, outcome
  FROM {schema}.inbox_store(%(sources)s::text[], %(event_ids)s::text[], %(bodies)s::bytea[],
                            %(headers)s::jsonb[], %(digests)s::bytea[], %(ordering_keys)s::text[],
                            %(versions)s::bigint[], %(now)s, %(channel)s)

-- name: claim
-- Locks pending, due events of the given sources and marks them done, in the worker's transaction:
-- the mark commits with the handlers' writes, and a failing handler's event is set back (fail) or
-- its whole batch rolled back, so no other session ever sees "done" for an event whose handler's
-- writes did not commit. Marking in the claim saves the batch a round trip.
-- One source per statement: an ordered scan of its part of inbox_pending, and on Citus one shard.
-- An event with an ordering key is taken only when it is the head of its key: no earlier event of
-- that key is still pending (being processed by another worker counts: its row stays pending for
-- others until that worker commits) or, when `blocking`, dead. SKIP LOCKED lets workers claim side
-- by side without waiting on each other.
UPDATE {schema}.inbox AS u
   SET status = 'done',
       processed_at = coalesce(%(now)s::timestamptz, now())
  FROM (SELECT i.source, i.event_id
          FROM {schema}.inbox AS i
         WHERE i.status = 'pending'
           AND i.source = %(source)s
           AND i.next_attempt_at <= coalesce(%(now)s::timestamptz, now())
           AND (i.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1
                  FROM {schema}.inbox AS h
                 WHERE h.source = i.source
                   AND h.ordering_key = i.ordering_key
                   AND h.status IN ('pending', 'dead')
                   AND (h.received_at, h.seq) < (i.received_at, i.seq)
                   AND (h.status = 'pending' OR %(blocking)s::boolean)))
         ORDER BY i.next_attempt_at
         LIMIT %(limit)s
           FOR UPDATE OF i SKIP LOCKED) AS c
 WHERE u.source = c.source AND u.event_id = c.event_id
RETURNING u.source, u.event_id, u.body, u.headers, u.attempts, u.received_at, u.ordering_key,
          u.version, u.next_attempt_at, u.seq

-- name: savepoint
SAVEPOINT pgonce_inbox_event

-- name: release_savepoint
RELEASE SAVEPOINT pgonce_inbox_event

-- name: next_savepoint
-- Two statements in one round trip (no parameters: the simple query protocol carries both).
RELEASE SAVEPOINT pgonce_inbox_event; SAVEPOINT pgonce_inbox_event

-- name: rollback_savepoint
ROLLBACK TO SAVEPOINT pgonce_inbox_event

-- name: skip
-- Claimed events dropped by the out-of-order policy: their handler did not run.
UPDATE {schema}.inbox
   SET status = 'skipped'
 WHERE source = %(source)s AND event_id = %(event_id)s

-- name: fail
-- A handler failure: retry at next_attempt_at, or dead-letter (status 'dead'). `expected` is
-- 'done' for a row claimed in this transaction, 'pending' after that transaction rolled back (then
-- a row another worker has finished meanwhile is left alone).
UPDATE {schema}.inbox
   SET attempts = attempts + 1,
       status = %(status)s,
       next_attempt_at = coalesce(%(next_attempt_at)s, next_attempt_at),
       last_error = %(error)s,
       processed_at = CASE WHEN %(status)s = 'dead' THEN coalesce(%(now)s::timestamptz, now()) END
 WHERE source = %(source)s AND event_id = %(event_id)s AND status = %(expected)s

-- name: claim_committed
-- Whether the claim of a batch whose transaction a handler ended committed: its event is still
-- marked done and nobody holds its row. After a rollback the row is pending, or locked by the
-- worker that claimed it since (SKIP LOCKED: no row), and is left to that worker.
SELECT status = 'done'
  FROM {schema}.inbox
 WHERE source = %(source)s AND event_id = %(event_id)s
   FOR UPDATE SKIP LOCKED

-- name: reopen
-- Events a committed claim marked done whose handlers never ran: pending again, no attempt
-- counted.
UPDATE {schema}.inbox
   SET status = 'pending',
       processed_at = NULL
 WHERE source = %(source)s AND event_id = ANY(%(event_ids)s) AND status = 'done'

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

-- name: register_waiting
-- This worker loop is about to sleep: inbox_store() notifies while the row is fresh.
INSERT INTO {schema}.inbox_waiting_workers (worker, since) VALUES (%(worker)s, now())
ON CONFLICT (worker) DO UPDATE SET since = excluded.since

-- name: unregister_waiting
DELETE FROM {schema}.inbox_waiting_workers WHERE worker = %(worker)s
