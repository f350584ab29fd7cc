-- Two-phase keys: leases with fencing tokens and recovery points (key_leases, 0016). {schema} is
-- pgonce's schema, composed with psycopg.sql.Identifier.
--
-- Each statement runs in a short transaction that pgonce owns (the caller handed it an idle
-- connection). Every write of a holder names its (scope, key, token): a holder whose lease was
-- taken over finds no row with its token and writes nothing; the row lock that its write takes
-- holds a concurrent takeover until the holder's transaction ends, and the takeover then reads
-- the lease the holder left (READ COMMITTED rechecks the row).

-- name: claim
-- The two-phase claim: the keys row (completed_at NULL, so that every duplicate, two-phase or not,
-- reads it as in flight) and its lease, in one statement. No row back: the key exists, and
-- take_over decides. The wait for a concurrent claim's open transaction is bounded as in
-- keys.claim_insert; the transaction is pgonce's own, so the setting is not restored.
-- A lease row already there when the keys row was just made is the past of a key that is gone
-- (released by the key store, deleted by hand): it is replaced, with a token above its holder's,
-- whose writes then find no row of theirs.
WITH claimed AS (
    INSERT INTO {schema}.keys (scope, key, fingerprint, claimed_at)
    SELECT %(scope)s, %(key)s, %(fingerprint)s, wait.at
      FROM (SELECT coalesce(%(now)s::timestamptz, now()) AS at,
                   set_config('lock_timeout', %(wait_ms)s, true)) AS wait
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING scope, key, claimed_at
)
INSERT INTO {schema}.key_leases (scope, key, token, locked_until, operation, args, point,
                                 state, attempts)
SELECT c.scope, c.key, nextval('{schema}.key_lease_tokens'),
       c.claimed_at + %(lease)s::interval, %(operation)s, %(args)s, NULL, %(state)s, 1
  FROM claimed AS c
ON CONFLICT (scope, key) DO UPDATE
   SET token = excluded.token, locked_until = excluded.locked_until,
       operation = excluded.operation, args = excluded.args, point = NULL,
       state = excluded.state, attempts = 1, last_error = NULL
RETURNING token, (SELECT claimed_at FROM claimed)

-- name: take_over
-- A claim that met an existing key: the stored row, and the lease taken over when it has expired,
-- the request is the same (fingerprint) and no response is stored yet. Always one row: the keys
-- columns are NULL when the key is gone again, the lease columns when nothing was taken over.
-- %(fingerprint)s NULL: the completer, which takes over whatever request the key holds.
-- %(max_age)s bounds the claim's age (NULL: any): the completer leaves older requests alone.
WITH k AS (
    SELECT fingerprint::bytea, claimed_at, completed_at, response_status, response_headers,
           response_body
      FROM {schema}.keys
     WHERE scope = %(scope)s AND key = %(key)s
), taken AS (
    UPDATE {schema}.key_leases AS l
       SET token = nextval('{schema}.key_lease_tokens'),
           locked_until = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval,
           attempts = l.attempts + 1
      FROM k
     WHERE l.scope = %(scope)s AND l.key = %(key)s
       AND l.locked_until <= coalesce(%(now)s::timestamptz, now())
       AND k.response_headers IS NULL
       AND k.fingerprint = coalesce(%(fingerprint)s::bytea, k.fingerprint)
       AND (%(max_age)s::interval IS NULL
            OR k.claimed_at >= coalesce(%(now)s::timestamptz, now()) - %(max_age)s::interval)
    RETURNING l.token, l.point, l.state, l.args, l.attempts, l.last_error
)
SELECT k.fingerprint, k.claimed_at, k.completed_at, k.response_status, k.response_headers,
       k.response_body, t.token, t.point, t.state, t.args, t.attempts, t.last_error
  FROM (VALUES (1)) AS one
  LEFT JOIN k ON true
  LEFT JOIN taken AS t ON true

-- name: record
-- A phase's recovery point and the state it reached, in the phase's own transaction, after the
-- phase's writes; the lease moves on too. No row: the lease was taken over, and the phase's
-- transaction must roll back.
UPDATE {schema}.key_leases
   SET point = %(point)s,
       state = %(state)s,
       locked_until = greatest(locked_until,
                               coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval)
 WHERE scope = %(scope)s AND key = %(key)s AND token = %(token)s
   AND locked_until <> 'infinity'

-- name: renew
-- The heartbeat: the holder's lease runs until now + lease. No row: it was taken over, or
-- retired (a retired row keeps locked_until 'infinity' for ever: no write of its holder may
-- bring it back as abandoned; record and fail are fenced the same way).
UPDATE {schema}.key_leases
   SET locked_until = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval
 WHERE scope = %(scope)s AND key = %(key)s AND token = %(token)s
   AND locked_until <> 'infinity'

-- name: fail
-- The holder gives the key up after a failure: the lease ends now, so that the next retry (or the
-- completer) takes over at once and resumes from the recovery point. No row: already taken over.
UPDATE {schema}.key_leases
   SET locked_until = least(locked_until, coalesce(%(now)s::timestamptz, now())),
       last_error = %(error)s
 WHERE scope = %(scope)s AND key = %(key)s AND token = %(token)s
   AND locked_until <> 'infinity'

-- name: finish
-- The final response, stored with the holder's token: the lease row goes and the keys row is
-- completed in one statement, after the final phase's writes in the same transaction. No row:
-- the lease was taken over (nothing is stored; the transaction must roll back).
WITH fenced AS (
    DELETE FROM {schema}.key_leases
     WHERE scope = %(scope)s AND key = %(key)s AND token = %(token)s
    RETURNING scope, key
)
UPDATE {schema}.keys AS k
   SET completed_at = coalesce(%(now)s::timestamptz, now()),
       response_status = %(status)s,
       response_headers = %(headers)s,
       response_body = %(body)s
  FROM fenced AS f
 WHERE k.scope = f.scope AND k.key = f.key AND k.response_headers IS NULL

-- name: retire
-- The completer gives a request up: its problem answer is stored with the holder's token, as by
-- finish, but the lease row stays, with locked_until 'infinity', as the record of the retirement
-- that health counts (by the recovery point it stopped at, with its attempts and last error). No
-- takeover, search or stuck check reads such a row (each wants an expired lease); the sweeper
-- deletes it with the key. No row: the lease was taken over (nothing is stored).
WITH fenced AS (
    UPDATE {schema}.key_leases
       SET locked_until = 'infinity'
     WHERE scope = %(scope)s AND key = %(key)s AND token = %(token)s
       AND locked_until <> 'infinity'
    RETURNING scope, key
)
UPDATE {schema}.keys AS k
   SET completed_at = coalesce(%(now)s::timestamptz, now()),
       response_status = %(status)s,
       response_headers = %(headers)s,
       response_body = %(body)s
  FROM fenced AS f
 WHERE k.scope = f.scope AND k.key = f.key AND k.response_headers IS NULL

-- name: release
-- A holder whose endpoint never began (refused before it ran: 401, 422) frees the key, as a
-- one-transaction route's rollback does: the lease row and the keys row go, fenced by the token
-- and by the recovery point (a request that recorded a phase keeps its key). No row: taken over,
-- or a phase was recorded.
WITH fenced AS (
    DELETE FROM {schema}.key_leases
     WHERE scope = %(scope)s AND key = %(key)s AND token = %(token)s
       AND point IS NULL AND locked_until <> 'infinity'
    RETURNING scope, key
)
DELETE FROM {schema}.keys AS k
 USING fenced AS f
 WHERE k.scope = f.scope AND k.key = f.key AND k.response_headers IS NULL

-- name: abandoned
-- Requests the completer may finish: an operation it runs (`operations`; NULL: any named one)
-- whose lease has expired, claimed no longer than `max_age` ago (NULL: any), oldest expiry
-- first (key_leases_expired reads only those). The rows the completer would skip are filtered
-- here, so that they never fill the page and starve the requests it can finish.
SELECT l.scope, l.key, l.operation, l.attempts
  FROM {schema}.key_leases AS l
 WHERE l.locked_until <= coalesce(%(now)s::timestamptz, now())
   AND l.operation IS NOT NULL
   AND (%(operations)s::text[] IS NULL OR l.operation = ANY (%(operations)s::text[]))
   AND (%(max_age)s::interval IS NULL
        OR EXISTS (SELECT 1
                     FROM {schema}.keys AS k
                    WHERE k.scope = l.scope AND k.key = l.key
                      AND k.claimed_at >= coalesce(%(now)s::timestamptz, now())
                                          - %(max_age)s::interval))
 ORDER BY l.locked_until
 LIMIT %(limit)s

-- name: bound_wait
-- The completer's takeover waits at most the store's wait for a holder whose phase is
-- committing (its record holds the lease row's lock until COMMIT), and moves on to the next.
SELECT set_config('lock_timeout', %(wait_ms)s, true)
