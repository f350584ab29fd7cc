-- Outbox statements. {schema} is pgonce's schema, composed with psycopg.sql.Identifier.

-- name: enqueue
-- One event in the caller's transaction; returns its id. One plain statement, no function call
-- (outbox_enqueue() spent as long in PL/pgSQL as in its two INSERTs):
--
-- locked: the aggregate's lock row, upserted first. Its row lock, held to commit, makes a second
-- transaction of the same aggregate wait here until the first one ended, so that the id it
-- allocates next is greater than every id the first one committed. Its RETURNING sends NOTIFY
-- while a relay waits (outbox_waiting_relays); delivered at commit, once per transaction however
-- many events it enqueued, never for a rollback.
--
-- The outbox row is inserted FROM locked: the INSERT computes a row's values, its id's nextval()
-- included, only once the CTE has returned that row, which it does after the upsert took the
-- lock (an upsert returns its one row, whether it inserted or updated). The same order through
-- scalar subqueries in a WHERE clause (a one-time filter before the INSERT's first row) set up a
-- Result node and two subplans on every execution: 9,600 more server instructions per
-- transaction (bench/outbox_instructions.py); count(*), before that, an aggregate node (9,000).
--
-- last_enqueued_at moves only when it is an hour behind (0018): it is indexed
-- (outbox_aggregates_by_age, for the sweeper), and an update that changes an indexed column can
-- never be HOT, so setting it on every enqueue gave each event of a known aggregate a new row
-- version on another page and an entry in both indexes (336,000 server instructions per business
-- transaction against 302,000 with the HOT update, bench/outbox_instructions.py). An hour is
-- nothing to the sweeper, which deletes a lock row only after a retention of days (and may
-- delete one at any time: the next enqueue recreates it).
WITH locked AS (
    INSERT INTO {schema}.outbox_aggregates AS a (aggregatetype, aggregateid, events,
                                                 last_enqueued_at)
    VALUES (%(aggregatetype)s::text, %(aggregateid)s::text, 1,
            coalesce(%(now)s::timestamptz, now()))
    ON CONFLICT (aggregatetype, aggregateid)
    DO UPDATE SET events = a.events + 1,
                  last_enqueued_at = CASE
                      WHEN excluded.last_enqueued_at >= a.last_enqueued_at + interval '1 hour'
                      THEN excluded.last_enqueued_at ELSE a.last_enqueued_at END
    -- The real clock, not the caller's: staleness is about relays that exist now.
    RETURNING (SELECT pg_notify(%(channel)s::text, '')
                WHERE EXISTS (SELECT FROM {schema}.outbox_waiting_relays
                               WHERE since > now() - interval '1 minute')) AS woken
)
INSERT INTO {schema}.outbox (aggregatetype, aggregateid, type, payload, headers, created_at,
                             next_attempt_at)
SELECT %(aggregatetype)s::text, %(aggregateid)s::text, %(type)s::text, %(payload)s::jsonb,
       coalesce(%(headers)s::jsonb, '{{}}'), coalesce(%(now)s::timestamptz, now()),
       coalesce(%(now)s::timestamptz, now())
  FROM locked
RETURNING id

-- name: enqueue_unordered
-- enqueue(ordered=False): the same without the lock row. A statement of its own rather than the
-- lock's CTE switched off by a parameter: a data-modifying CTE is set up on every execution even
-- when it writes nothing (its table opened, its arbiter index prepared), which cost that
-- statement 42,000 of its 224,000 server instructions (bench/outbox_instructions.py). One INSERT
-- ... VALUES, the NOTIFY check in its RETURNING (an uncorrelated subquery: run once), which the
-- caller ignores: a CTE read by a scalar subquery in a WHERE clause cost 5,800 more.
INSERT INTO {schema}.outbox (aggregatetype, aggregateid, type, payload, headers, created_at,
                             next_attempt_at)
VALUES (%(aggregatetype)s::text, %(aggregateid)s::text, %(type)s::text, %(payload)s::jsonb,
        coalesce(%(headers)s::jsonb, '{{}}'), coalesce(%(now)s::timestamptz, now()),
        coalesce(%(now)s::timestamptz, now()))
RETURNING id,
          (SELECT pg_notify(%(channel)s::text, '')
            WHERE EXISTS (SELECT FROM {schema}.outbox_waiting_relays
                           WHERE since > now() - interval '1 minute')) AS woken

-- name: enqueue_many
-- Several events in one statement, in the order given; returns their ids (ascending, one per
-- event, in that order). As enqueue, with one lock row per aggregate of the batch, upserted in a
-- fixed order (so two batches naming the same aggregates never wait on each other in a cycle),
-- all taken before the first id is allocated.
WITH e AS MATERIALIZED (
    SELECT e.aggregatetype, e.aggregateid, e.type, e.payload, e.headers, e.n
      FROM ROWS FROM (unnest(%(aggregatetypes)s::text[]), unnest(%(aggregateids)s::text[]),
                      unnest(%(types)s::text[]), jsonb_array_elements(%(payloads)s::jsonb),
                      jsonb_array_elements(%(headers)s::jsonb))
           WITH ORDINALITY AS e (aggregatetype, aggregateid, type, payload, headers, n)
), locked AS (
    INSERT INTO {schema}.outbox_aggregates AS a (aggregatetype, aggregateid, events,
                                                 last_enqueued_at)
    SELECT e.aggregatetype, e.aggregateid, count(*), coalesce(%(now)s::timestamptz, now())
      FROM e
     GROUP BY e.aggregatetype, e.aggregateid
     ORDER BY e.aggregatetype COLLATE "C", e.aggregateid COLLATE "C"
    ON CONFLICT (aggregatetype, aggregateid)
    -- last_enqueued_at to the hour, as in enqueue (a HOT update).
    DO UPDATE SET events = a.events + excluded.events,
                  last_enqueued_at = CASE
                      WHEN excluded.last_enqueued_at >= a.last_enqueued_at + interval '1 hour'
                      THEN excluded.last_enqueued_at ELSE a.last_enqueued_at END
    RETURNING 1
), woken AS (
    SELECT pg_notify(%(channel)s::text, '')
     WHERE EXISTS (SELECT FROM {schema}.outbox_waiting_relays
                    WHERE since > now() - interval '1 minute')
)
-- The events sorted in a subquery, so that the INSERT allocates their ids in the given order.
INSERT INTO {schema}.outbox (aggregatetype, aggregateid, type, payload, headers, created_at,
                             next_attempt_at)
SELECT s.aggregatetype, s.aggregateid, s.type, s.payload, s.headers,
       coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now())
  FROM (SELECT * FROM e ORDER BY e.n OFFSET 0) AS s
 -- count(*), which reads every lock row before the first id: a data-modifying CTE read only in
 -- part finishes its writes after the main statement, when the ids are taken.
 WHERE (SELECT count(*) FROM locked) >= 0 AND coalesce((SELECT 1 FROM woken), 0) >= 0
RETURNING id

-- name: enqueue_many_unordered
-- enqueue_many(ordered=False): as enqueue_many without the lock rows (see enqueue_unordered).
WITH woken AS (
    SELECT pg_notify(%(channel)s::text, '')
     WHERE EXISTS (SELECT FROM {schema}.outbox_waiting_relays
                    WHERE since > now() - interval '1 minute')
)
INSERT INTO {schema}.outbox (aggregatetype, aggregateid, type, payload, headers, created_at,
                             next_attempt_at)
SELECT e.aggregatetype, e.aggregateid, e.type, e.payload, e.headers,
       coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now())
  FROM ROWS FROM (unnest(%(aggregatetypes)s::text[]), unnest(%(aggregateids)s::text[]),
                  unnest(%(types)s::text[]), jsonb_array_elements(%(payloads)s::jsonb),
                  jsonb_array_elements(%(headers)s::jsonb))
       WITH ORDINALITY AS e (aggregatetype, aggregateid, type, payload, headers, n)
 WHERE coalesce((SELECT 1 FROM woken), 0) >= 0
 ORDER BY e.n
RETURNING id

-- name: claim
-- A batch for one relay: up to `limit` rows, at most `per_aggregate` per aggregate, returned in id
-- order.
--
-- heads: the oldest pending row of each aggregate, if it is due, locked FOR UPDATE SKIP LOCKED.
-- Holding an aggregate's head keeps the other relays off the aggregate's later rows while no row
-- below it can become pending: ordered producers never commit below a visible row (the lock row),
-- and a replay waits for the relay. An unordered event can: committed after a relay took a later
-- row of its aggregate as head, it is a new head below the held one, and the next relay's prefix
-- runs into the rows in flight. So each later row of the prefix is locked too, FOR UPDATE SKIP
-- LOCKED in a subquery of its own, and the prefix ends before the first row that another relay
-- holds (or published or parked since this statement's snapshot): `gaps` counts the rows not
-- taken so far, in id order, and only the rows before the first of them join the batch. No relay
-- then hands out a row it does not hold, nor row N+1 of an aggregate while another relay holds
-- row N. Every exclusion a concurrent commit can cause is on the safe side: a row is skipped this
-- round, never taken out of order. The subquery finds its row by ctid (a TID scan, not a second
-- descent of the primary key; a row updated since is followed to its latest version and its
-- conditions rechecked), and the head, locked already, is not locked twice (CASE). The window
-- stops at the first gap (its run condition) but reads one row ahead: the row after a gap, or
-- after an aggregate's last row in the batch, may be locked too and held unpublished until the
-- transaction ends, behind a head this relay holds, where no other relay takes it anyway (the
-- next batch does). The row locks cost the claim 0.17 ms more per 100 rows (0.17 against 0.35
-- ms; a WAL record each) and no round trip; an advisory lock per aggregate instead could exhaust
-- the lock table on a batch of many aggregates (max_locks_per_transaction).
--
-- The batch takes aggregates in the order of their heads, each with its prefix, until `limit`
-- rows: the inner LIMIT stops the join, and the join reads heads from the CTE only as it needs
-- them, so a batch walks and locks only the heads it publishes (50 heads for 200 rows of four
-- events each, where sorting the whole join first locked 200 and walked 800 rows: 1.4 against
-- 4 ms). Only those 200 rows are sorted.
--
-- "Oldest" is a correlated min() rather than NOT EXISTS: a subplan always probes the index by
-- aggregate, where an anti-join planned on a fresh table's missing statistics scanned it whole.
-- It is written `o.id <= min(...)`, which means `=` here (the row is pending, so the minimum is
-- at most its own id), because the planner estimates `= (subplan)` at one row in 200: below
-- the LIMIT, so it read every pending row and sorted them (48 ms for a batch of 20,000 pending
-- rows). With the inequality's estimate (a third) it walks outbox_pending in id order and stops
-- at the LIMIT.
WITH heads AS (
    SELECT o.id, o.aggregatetype, o.aggregateid
      FROM {schema}.outbox AS o
     WHERE o.published_at IS NULL AND o.parked_at IS NULL
       AND o.next_attempt_at <= coalesce(%(now)s::timestamptz, now())
       AND o.id <= (
           SELECT min(e.id)
             FROM {schema}.outbox AS e
            WHERE e.aggregatetype = o.aggregatetype AND e.aggregateid = o.aggregateid
              AND e.published_at IS NULL AND e.parked_at IS NULL)
     ORDER BY o.id
     LIMIT %(limit)s
       FOR UPDATE OF o SKIP LOCKED
)
-- The payload comes as text, to go to the broker as it is; headers are NULL when empty (the
-- common case), which spares decoding an empty object per row.
SELECT b.id, b.aggregatetype, b.aggregateid, b.type, b.payload, b.headers, b.created_at,
       b.attempts
  FROM (SELECT r.id, r.aggregatetype, r.aggregateid, r.type, r.payload::text AS payload,
               nullif(r.headers, '{{}}') AS headers, r.created_at, r.attempts
          FROM heads AS h
         CROSS JOIN LATERAL (
               SELECT t.*
                 FROM (SELECT p.*,
                              count(*) FILTER (WHERE NOT p.taken)
                                  OVER (ORDER BY p.id ROWS UNBOUNDED PRECEDING) AS gaps
                         FROM (SELECT o.*,
                                      CASE WHEN o.id = h.id THEN true
                                           ELSE (SELECT true
                                                   FROM {schema}.outbox AS l
                                                  WHERE l.ctid = o.ctid AND l.published_at IS NULL
                                                    AND l.parked_at IS NULL
                                                    FOR UPDATE OF l SKIP LOCKED) IS NOT NULL
                                      END AS taken
                                 FROM {schema}.outbox AS o
                                WHERE o.aggregatetype = h.aggregatetype
                                  AND o.aggregateid = h.aggregateid
                                  AND o.published_at IS NULL AND o.parked_at IS NULL
                                  AND o.id >= h.id
                                ORDER BY o.id
                                LIMIT %(per_aggregate)s) AS p) AS t
                WHERE t.gaps = 0) AS r
         LIMIT %(limit)s) AS b
 ORDER BY b.id

-- name: mark_published
UPDATE {schema}.outbox
   SET published_at = coalesce(%(now)s::timestamptz, now()), last_error = NULL
 WHERE id = ANY(%(ids)s::bigint[]) AND published_at IS NULL

-- name: record_refusals
-- One row per refused delivery; the core decided the next attempt or the parking.
UPDATE {schema}.outbox AS o
   SET attempts = r.attempts,
       next_attempt_at = r.next_attempt_at,
       parked_at = r.parked_at,
       last_error = r.last_error
  FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(next_attempt_at)s::timestamptz[],
              %(parked_at)s::timestamptz[], %(last_error)s::text[])
       AS r (id, attempts, next_attempt_at, parked_at, last_error)
 WHERE o.id = r.id AND o.published_at IS NULL

-- name: replay_hold
-- replay()'s first statement: the lock rows of the aggregates it replays, taken as enqueue()
-- takes them (in enqueue_many's order), so that no ordered producer of theirs commits an event
-- until the replay has. A replayed row becomes its aggregate's oldest pending row, and a relay
-- holds an aggregate by its oldest pending row (see claim): the replay must not commit
-- while a relay publishes later rows of the aggregate, nor while one could start to.
INSERT INTO {schema}.outbox_aggregates AS a (aggregatetype, aggregateid, events,
                                             last_enqueued_at)
SELECT p.aggregatetype, p.aggregateid, 0, coalesce(%(now)s::timestamptz, now())
  FROM (SELECT DISTINCT o.aggregatetype, o.aggregateid
          FROM {schema}.outbox AS o
         WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL
           AND (%(ids)s::bigint[] IS NULL OR o.id = ANY(%(ids)s::bigint[]))
           AND (%(aggregatetype)s::text IS NULL
                OR o.aggregatetype = %(aggregatetype)s::text)) AS p
 ORDER BY p.aggregatetype COLLATE "C", p.aggregateid COLLATE "C"
ON CONFLICT (aggregatetype, aggregateid) DO UPDATE SET events = a.events

-- name: replay_wait
-- replay()'s second statement, with a snapshot taken once the lock rows are held: the pending
-- rows of those aggregates, locked in id order, which waits for a relay that holds one (it
-- holds the oldest, and is waited for before any later row of its batch is locked) and keeps
-- every relay off them until the replay commits.
SELECT o.id
  FROM {schema}.outbox AS o
 WHERE o.published_at IS NULL AND o.parked_at IS NULL
   AND (o.aggregatetype, o.aggregateid) IN (
       SELECT p.aggregatetype, p.aggregateid
         FROM {schema}.outbox AS p
        WHERE p.parked_at IS NOT NULL AND p.published_at IS NULL
          AND (%(ids)s::bigint[] IS NULL OR p.id = ANY(%(ids)s::bigint[]))
          AND (%(aggregatetype)s::text IS NULL OR p.aggregatetype = %(aggregatetype)s::text))
 ORDER BY o.id
   FOR UPDATE OF o

-- name: replay
-- Parked rows back into the queue: due at once, attempts from zero.
UPDATE {schema}.outbox
   SET parked_at = NULL, attempts = 0, last_error = NULL,
       next_attempt_at = coalesce(%(now)s::timestamptz, now())
 WHERE parked_at IS NOT NULL AND published_at IS NULL
   AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
   AND (%(aggregatetype)s::text IS NULL OR aggregatetype = %(aggregatetype)s::text)
RETURNING id

-- name: notify
SELECT pg_notify(%(channel)s, '')

-- name: register_waiting
-- This relay is about to sleep: enqueue() notifies while the row is fresh.
INSERT INTO {schema}.outbox_waiting_relays (relay, since) VALUES (%(relay)s, now())
ON CONFLICT (relay) DO UPDATE SET since = excluded.since

-- name: unregister_waiting
DELETE FROM {schema}.outbox_waiting_relays WHERE relay = %(relay)s

-- name: counts
-- Every state, published rows included: a count of the retention, for a person who asks (the admin
-- page) and for tests. The metrics read backlog instead.
SELECT count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL) AS pending,
       count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL
                          AND next_attempt_at > coalesce(%(now)s::timestamptz, now())) AS waiting,
       count(*) FILTER (WHERE parked_at IS NOT NULL AND published_at IS NULL) AS parked,
       count(*) FILTER (WHERE published_at IS NOT NULL) AS published,
       min(created_at) FILTER (WHERE published_at IS NULL AND parked_at IS NULL) AS oldest_pending
  FROM {schema}.outbox

-- name: backlog
-- What the relay has yet to do, for the metrics at every scrape: pending rows (those of them waiting
-- out a backoff, the oldest) in one read of outbox_pending, and parked rows from outbox_parked;
-- never the published rows of the retention.
SELECT p.pending, p.waiting,
       (SELECT count(*) FROM {schema}.outbox
         WHERE parked_at IS NOT NULL AND published_at IS NULL) AS parked,
       p.oldest_pending
  FROM (SELECT count(*) AS pending,
               count(*) FILTER (WHERE next_attempt_at > coalesce(%(now)s::timestamptz, now()))
                   AS waiting,
               min(created_at) AS oldest_pending
          FROM {schema}.outbox
         WHERE published_at IS NULL AND parked_at IS NULL) AS p
