-- Key store statements. {schema} is pgonce's schema, composed with psycopg.sql.Identifier.

-- name: claim
SELECT state, fingerprint, claimed_at, completed_at, response_status, response_headers, response_body
  FROM {schema}.claim(%(scope)s, %(key)s, %(fingerprint)s, %(wait_ms)s, %(now)s)

-- name: claim_insert
-- begin()'s claim: two statements in the round trip that opens the transaction. The claim()
-- function above does the same in one statement, but a PL/pgSQL call costs the server more than
-- the INSERT itself (16 connections, pgbench: a replay 12 to 30 per cent faster through plain
-- statements, a fresh key 3 to 17; the keys benchmark measures both). claim() keeps the function:
-- inside the caller's transaction a lock timeout must not abort it, and only the function's
-- exception block can catch one. begin() owns its transaction, so it lets the timeout abort it,
-- rolls back and answers in flight.
--
-- The INSERT's own row source sets the bound of its wait for a concurrent claim of the same key
-- (lock_timeout is read when a wait begins, after the row was made) and keeps the caller's value
-- for claim_read to put back, so that the caller's own statements run with their own. One
-- statement rather than a SELECT of its own before the INSERT: 16 per cent more fresh keys a
-- second through pgbench at 16 connections (median of six alternated pairs).
INSERT INTO {schema}.keys (scope, key, fingerprint, claimed_at)
SELECT %(scope)s, %(key)s, %(fingerprint)s, coalesce(%(now)s::timestamptz, now())
  FROM (SELECT set_config('pgonce.lock_timeout', current_setting('lock_timeout'), true),
               set_config('lock_timeout', %(wait_ms)s, true)) AS wait
ON CONFLICT (scope, key) DO NOTHING
RETURNING claimed_at

-- name: claim_read
-- The stored row, for when the INSERT did nothing. A statement of its own has a snapshot of its
-- own: it sees the row of a concurrent claim that committed while the INSERT waited for it.
-- After a won INSERT it reads the new row (ignored). Always one row: its columns are NULL when
-- there is no stored row (the claim it conflicted with is gone again).
SELECT set_config('lock_timeout', current_setting('pgonce.lock_timeout'), true) AS restored,
       k.fingerprint::bytea, k.claimed_at, k.completed_at, k.response_status,
       k.response_headers, k.response_body
  FROM (VALUES (1)) AS one
  LEFT JOIN {schema}.keys AS k ON k.scope = %(scope)s AND k.key = %(key)s

-- name: complete
-- Only a claim still in flight is completed: a second completion changes nothing.
UPDATE {schema}.keys
   SET completed_at = coalesce(%(now)s::timestamptz, now()),
       response_status = %(status)s,
       response_headers = %(headers)s,
       response_body = %(body)s
 WHERE scope = %(scope)s AND key = %(key)s AND completed_at IS NULL

-- name: release
-- Frees a claim in the current transaction (a 5xx that is not stored): the next retry runs anew.
DELETE FROM {schema}.keys
 WHERE scope = %(scope)s AND key = %(key)s AND completed_at IS NULL
