-- Health statements. {schema} is pgonce's schema, composed with psycopg.sql.Identifier.
--
-- Each sweep target has `horizon_<target>`: one row per scope group of its retention policy, over
-- the rows that are deletable once old (the same predicate as its delete_<target> in sweep.sql).
-- Parameters as in sweep.sql (now, default_keep, scopes, keeps). Columns:
--   scope       the scope with its own retention, or NULL for every other scope
--   rows        deletable-once-old rows in the group
--   oldest_age  age of the oldest of them at `now` (NULL when there are none)
--   overdue     rows already past their retention
-- A target whose rows can get stuck also has `stuck_<target>` (count, age of the oldest).
-- These statements read whole tables: run them every few minutes, not every second.

-- name: clock
SELECT coalesce(%(now)s::timestamptz, now())

-- name: horizon_keys
SELECT p.scope,
       count(*) AS rows,
       coalesce(%(now)s::timestamptz, now()) - min(k.claimed_at) AS oldest_age,
       count(*) FILTER (
           WHERE k.claimed_at < coalesce(%(now)s::timestamptz, now())
                                - coalesce(p.keep, %(default_keep)s::interval)
       ) AS overdue
  FROM {schema}.keys AS k
  LEFT JOIN unnest(%(scopes)s::text[], %(keeps)s::interval[]) AS p(scope, keep)
         ON p.scope = k.scope
 WHERE k.completed_at IS NOT NULL
 GROUP BY p.scope

-- name: stuck_keys
-- Claims committed without a response and older than the threshold (the keys_incomplete index).
SELECT count(*), coalesce(%(now)s::timestamptz, now()) - min(claimed_at)
  FROM {schema}.keys
 WHERE completed_at IS NULL
   AND claimed_at < coalesce(%(now)s::timestamptz, now()) - %(stuck_after)s::interval
