-- The operator console's reads (service/console): search, detail and charts. {schema} is pgonce's
-- schema. Nothing here writes: replays go through the stores' own replay statements.
--
-- Every listing is a page by keyset (the last row's sort key is the next page's bound, `after_*`),
-- never OFFSET, and every statement reads an index range (tests/test_indexes.py holds them to it):
-- a console page costs the rows it shows, not the retention.

-- name: keys_page
-- One scope's keys from a key prefix ('' for all), in key order: a range of keys_pkey.
SELECT scope, key, claimed_at, completed_at, response_status
  FROM {schema}.keys
 WHERE scope = %(scope)s
   AND starts_with(key, %(prefix)s)
   AND key > %(after)s
 ORDER BY key
 LIMIT %(limit)s

-- name: key_detail
-- What was asked and what was answered, for one key (keys_pkey).
SELECT scope, key, encode(fingerprint, 'hex'), claimed_at, completed_at, response_status,
       response_headers, response_body
  FROM {schema}.keys
 WHERE scope = %(scope)s AND key = %(key)s

-- name: events_dead
-- Dead letters, newest first, of one source or all (inbox_dead).
SELECT source, event_id, status, attempts, received_at, next_attempt_at, processed_at,
       left(last_error, 300), octet_length(body)
  FROM {schema}.inbox
 WHERE status = 'dead'
   AND (%(source)s::text IS NULL OR source = %(source)s)
   AND (received_at, source, event_id) < (%(after_at)s, %(after_source)s, %(after_id)s)
 ORDER BY received_at DESC, source DESC, event_id DESC
 LIMIT %(limit)s

-- name: events_pending
-- Events waiting for a worker (or a retry), newest first (inbox_pending: the backlog only).
SELECT source, event_id, status, attempts, received_at, next_attempt_at, processed_at,
       left(last_error, 300), octet_length(body)
  FROM {schema}.inbox
 WHERE status = 'pending'
   AND (%(source)s::text IS NULL OR source = %(source)s)
   AND (received_at, source, event_id) < (%(after_at)s, %(after_source)s, %(after_id)s)
 ORDER BY received_at DESC, source DESC, event_id DESC
 LIMIT %(limit)s

-- name: events_finished
-- Handled events (done, skipped), newest first: a backward range of inbox_finished_by_age.
SELECT source, event_id, status, attempts, received_at, next_attempt_at, processed_at,
       left(last_error, 300), octet_length(body)
  FROM {schema}.inbox
 WHERE status IN ('done', 'skipped')
   AND (%(status)s::text IS NULL OR status = %(status)s)
   AND (%(source)s::text IS NULL OR source = %(source)s)
   AND received_at <= %(after_at)s
   AND (received_at, source, event_id) < (%(after_at)s, %(after_source)s, %(after_id)s)
 ORDER BY received_at DESC, source DESC, event_id DESC
 LIMIT %(limit)s

-- name: event_by_id
-- An event id looked up in every configured source (inbox_pkey, one probe per source).
SELECT source, event_id, status, attempts, received_at, next_attempt_at, processed_at,
       left(last_error, 300), octet_length(body)
  FROM {schema}.inbox
 WHERE source = ANY (%(sources)s::text[]) AND event_id = %(event_id)s
 ORDER BY source

-- name: outbox_page
-- Outbox rows, newest first, by id (outbox_pkey, read backwards): any state, or published ones.
SELECT id, aggregatetype, aggregateid, type, created_at, published_at, attempts, next_attempt_at,
       left(last_error, 300), parked_at
  FROM {schema}.outbox
 WHERE id < %(after_id)s
   AND (NOT %(published)s OR published_at IS NOT NULL)
   AND (%(aggregatetype)s::text IS NULL OR aggregatetype = %(aggregatetype)s)
   AND (%(aggregateid)s::text IS NULL OR aggregateid = %(aggregateid)s)
 ORDER BY id DESC
 LIMIT %(limit)s

-- name: outbox_page_pending
-- Rows the relay has still to publish (outbox_pending), newest first.
SELECT id, aggregatetype, aggregateid, type, created_at, published_at, attempts, next_attempt_at,
       left(last_error, 300), parked_at
  FROM {schema}.outbox
 WHERE published_at IS NULL AND parked_at IS NULL
   AND id < %(after_id)s
   AND (%(aggregatetype)s::text IS NULL OR aggregatetype = %(aggregatetype)s)
   AND (%(aggregateid)s::text IS NULL OR aggregateid = %(aggregateid)s)
 ORDER BY id DESC
 LIMIT %(limit)s

-- name: outbox_page_parked
-- Parked rows, waiting for a person and a replay (outbox_parked), newest first.
SELECT id, aggregatetype, aggregateid, type, created_at, published_at, attempts, next_attempt_at,
       left(last_error, 300), parked_at
  FROM {schema}.outbox
 WHERE parked_at IS NOT NULL AND published_at IS NULL
   AND id < %(after_id)s
   AND (%(aggregatetype)s::text IS NULL OR aggregatetype = %(aggregatetype)s)
   AND (%(aggregateid)s::text IS NULL OR aggregateid = %(aggregateid)s)
 ORDER BY id DESC
 LIMIT %(limit)s

-- name: outbox_detail
-- One outbox row with its payload and headers (outbox_pkey).
SELECT id, aggregatetype, aggregateid, type, created_at, published_at, attempts, next_attempt_at,
       last_error, parked_at, payload::text, headers::text
  FROM {schema}.outbox
 WHERE id = %(id)s

-- Charts. Each returns (bucket, value) pairs: bucket n covers [since + n * step, since + (n+1) *
-- step); bucket -1 gathers everything before `since` (the level a backlog starts the chart with).
-- Buckets without rows are absent; the console fills them with zeros.

-- name: chart_keys
-- Keys completed per bucket: the API calls pgonce answered, by the time of the answer
-- (keys_by_completion).
SELECT floor(extract(epoch FROM completed_at - %(since)s::timestamptz) / %(step_s)s)::integer, count(*)
  FROM {schema}.keys
 WHERE completed_at >= %(since)s::timestamptz
 GROUP BY 1

-- name: chart_inbox
-- Deliveries stored per bucket, by their status now: handled ones through inbox_finished_by_age,
-- the backlog and the dead letters through their partial indexes.
SELECT floor(extract(epoch FROM received_at - %(since)s::timestamptz) / %(step_s)s)::integer,
       status, count(*)
  FROM (SELECT received_at, status FROM {schema}.inbox
         WHERE status IN ('done', 'skipped') AND received_at >= %(since)s::timestamptz
        UNION ALL
        SELECT received_at, status FROM {schema}.inbox
         WHERE status = 'pending' AND received_at >= %(since)s::timestamptz
        UNION ALL
        SELECT received_at, status FROM {schema}.inbox
         WHERE status = 'dead' AND received_at >= %(since)s::timestamptz) AS r
 GROUP BY 1, 2

-- name: chart_inbox_backlog
-- The inbox backlog as changes: +1 when a delivery arrived, -1 when it was handled (or
-- dead-lettered). Rows: the backlog now, and finished ones received since `since` minus one
-- span: a delivery handled more than a span after it arrived is not drawn.
SELECT greatest(-1, floor(extract(epoch FROM at - %(since)s::timestamptz) / %(step_s)s))::integer,
       sum(delta)::bigint
  FROM (SELECT received_at AS at, 1 AS delta FROM {schema}.inbox
         WHERE status = 'pending'
        UNION ALL
        SELECT received_at, 1 FROM {schema}.inbox
         WHERE status IN ('done', 'skipped')
           AND received_at >= %(since)s::timestamptz - %(span)s::interval
        UNION ALL
        SELECT processed_at, -1 FROM {schema}.inbox
         WHERE status IN ('done', 'skipped')
           AND received_at >= %(since)s::timestamptz - %(span)s::interval
        UNION ALL
        SELECT received_at, 1 FROM {schema}.inbox
         WHERE status = 'dead' AND received_at >= %(since)s::timestamptz - %(span)s::interval
        UNION ALL
        SELECT processed_at, -1 FROM {schema}.inbox
         WHERE status = 'dead' AND received_at >= %(since)s::timestamptz - %(span)s::interval
       ) AS d
 GROUP BY 1

-- name: chart_outbox
-- Rows published per bucket (outbox_published_at).
SELECT floor(extract(epoch FROM published_at - %(since)s::timestamptz) / %(step_s)s)::integer,
       count(*)
  FROM {schema}.outbox
 WHERE published_at >= %(since)s::timestamptz
 GROUP BY 1

-- name: chart_outbox_backlog
-- The outbox backlog as changes: +1 when a row was enqueued, -1 when it was published. Rows: those
-- published since `since` (outbox_published_at) and those still waiting (outbox_pending); exact.
SELECT greatest(-1, floor(extract(epoch FROM at - %(since)s::timestamptz) / %(step_s)s))::integer,
       sum(delta)::bigint
  FROM (SELECT created_at AS at, 1 AS delta FROM {schema}.outbox
         WHERE published_at >= %(since)s::timestamptz
        UNION ALL
        SELECT published_at, -1 FROM {schema}.outbox
         WHERE published_at >= %(since)s::timestamptz
        UNION ALL
        SELECT created_at, 1 FROM {schema}.outbox
         WHERE published_at IS NULL AND parked_at IS NULL) AS d
 GROUP BY 1

-- name: outbox_counts_by_type
-- Pending and parked rows per aggregate type, for the outbox page's filters: each branch an
-- index-only read of its partial index (outbox_pending_aggregate, outbox_parked).
SELECT aggregatetype, 'pending' AS state, count(*)
  FROM {schema}.outbox
 WHERE published_at IS NULL AND parked_at IS NULL
 GROUP BY aggregatetype
UNION ALL
SELECT aggregatetype, 'parked', count(*)
  FROM {schema}.outbox
 WHERE parked_at IS NOT NULL AND published_at IS NULL
 GROUP BY aggregatetype
 ORDER BY 1, 2

-- name: sweep_marks
-- What the sweeper deleted, per target and scope (the health page).
SELECT target, scope, deleted, newest, swept_at
  FROM {schema}.sweep_marks
 ORDER BY target, scope
