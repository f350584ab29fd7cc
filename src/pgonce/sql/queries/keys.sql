-- Key store statements. {schema} is pgonce's schema, composed with psycopg.sql.Identifier.

-- name: claim
SELECT state, fingerprint, claimed_at, completed_at, response_status, response_headers, response_body
  FROM {schema}.claim(%(scope)s, %(key)s, %(fingerprint)s, %(wait_ms)s, %(now)s)

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
