-- Key store statements. {schema} is pgonce's schema, composed with psycopg.sql.Identifier.

-- name: claim
SELECT state, fingerprint, claimed_at, completed_at, response_status, response_headers, response_body
  FROM {schema}.claim(%(scope)s, %(key)s, %(fingerprint)s, %(wait_ms)s, %(now)s)

-- name: claim_completed
-- once()'s claim in the caller's transaction where pgonce's batches cannot run (inside psycopg's
-- pipeline): the row is born with completed_at set (0013), as begin()'s is, so that its
-- completion is a HOT update. once()'s savepoint ends with the completion or is rolled back with
-- the claim; a bare claim() may be committed without a response, and keeps completed_at NULL for
-- the stuck-claims check.
SELECT state, fingerprint, claimed_at, completed_at, response_status, response_headers, response_body
  FROM {schema}.claim(%(scope)s, %(key)s, %(fingerprint)s, %(wait_ms)s, %(now)s, true)

-- name: claim_insert
-- begin()'s claim: the INSERT travels with BEGIN in the round trip that opens the transaction. The
-- claim() function above does the same in one statement, but a PL/pgSQL call costs the server more
-- than the INSERT itself (16 connections, pgbench: a replay 12 to 30 per cent faster through plain
-- statements, a fresh key 3 to 17; the keys benchmark measures both). A bare claim() keeps the
-- function: inside the caller's transaction a lock timeout must not abort it, and with no
-- savepoint of pgonce's around it only the function's exception block can catch one. begin()
-- owns its transaction, so it lets the timeout abort it, rolls back and answers in flight; once()
-- in the caller's transaction sends this INSERT after its SAVEPOINT, in the same round trip, and
-- rolls back to the savepoint instead.
--
-- The INSERT's own row source sets the bound of its wait for a concurrent claim of the same key
-- (lock_timeout is read when a wait begins, after the row was made) and keeps the caller's value;
-- RETURNING, computed only for a row this INSERT made, puts it back, so that the winner's own
-- statements run with their own value. A duplicate gets no row back, and begin() then reads the
-- stored row (claim_read) together with COMMIT: its transaction wrote nothing and ends there. One
-- statement rather than a SELECT of its own before the INSERT: 16 per cent more fresh keys a
-- second through pgbench at 16 connections (median of six alternated pairs).
--
-- The row is born with completed_at set: begin()'s transaction either stores the response
-- (commit()) or rolls back, so nobody ever reads the row without it, and the completion then
-- changes no column that an index reads (keys_by_completion indexes completed_at): a HOT
-- update, which writes no index entry and a smaller WAL record, as long as the new version fits
-- on the row's page (the table's fillfactor keeps room for it, 0013).
-- Whether a response was stored is response_headers IS NULL or not (see the keys table).
--
-- RETURNING also gives the row's ctid: commit() completes the row by it (see complete); and the
-- id of the transaction, by which commit()'s guard knows that transaction is still the one open.
--
-- What the bound costs the server (python -m bench.instructions, PostgreSQL 18, one connection,
-- BEGIN + this INSERT + COMMIT): 162,000 instructions against 135,000 for the INSERT without it;
-- 11,000 of the difference set lock_timeout (the row source that orders it before the wait
-- included), 16,000 keep the caller's value in pgonce.lock_timeout and put it back. Measured and
-- no cheaper: the caller's value kept in a MATERIALIZED CTE that RETURNING reads (+6,000), a
-- one-time filter (SELECT ... WHERE) instead of the row source (within the runs' spread of
-- 3,000), keeping the caller's value only when it is not 0 (+4,000 to +6,000). `SET LOCAL ...
-- TO DEFAULT` would be cheap but restores the configured default, not a session's own SET, and
-- only a function's SET clause scopes a setting to one call by itself, at the price of a
-- function call, which costs the server more than the whole bound (see above).
INSERT INTO {schema}.keys (scope, key, fingerprint, claimed_at, completed_at)
SELECT %(scope)s, %(key)s, %(fingerprint)s, wait.at, wait.at
  FROM (SELECT coalesce(%(now)s::timestamptz, now()) AS at,
               set_config('pgonce.lock_timeout', current_setting('lock_timeout'), true),
               set_config('lock_timeout', %(wait_ms)s, true)) AS wait
ON CONFLICT (scope, key) DO NOTHING
RETURNING claimed_at, set_config('lock_timeout', current_setting('pgonce.lock_timeout'), true),
          ctid, pg_current_xact_id()

-- name: claim_read
-- The stored row, after begin()'s INSERT did nothing; sent with COMMIT. A statement of its own has
-- a snapshot of its own: it sees the row of a concurrent claim that committed while the INSERT
-- waited for it. Always one row: its columns are NULL when there is no stored row (the claim the
-- INSERT conflicted with is gone again).
SELECT k.fingerprint::bytea, k.claimed_at, k.completed_at, k.response_status,
       k.response_headers, k.response_body
  FROM (VALUES (1)) AS one
  LEFT JOIN {schema}.keys AS k ON k.scope = %(scope)s AND k.key = %(key)s

-- name: complete
-- Only a claim without a response is completed: a second completion changes nothing. A claim of
-- begin() or once() keeps the completed_at it was born with (unless a time is given), so that
-- nothing an index reads changes and the update is HOT; a bare claim() gets its completion time
-- here (and a new keys_by_completion entry: not a HOT update).
--
-- commit() appends `AND ctid = $row::tid` for a claim of begin(): the row is reached by the ctid
-- its INSERT returned (a TID scan) instead of descending the primary key. The row cannot have
-- moved: it is this transaction's own, so no other transaction can update it, and pruning keeps
-- a live row's line pointer. Should this transaction have updated or deleted it meanwhile
-- (complete(), release()), that ctid names a version this statement no longer sees, and the
-- completion changes nothing, as a second completion by key does; scope and key still guard it.
-- callgrind, PostgreSQL 15, one connection (python -m bench.instructions): the server's backend
-- runs 17,000 fewer instructions of the 295,000 that BEGIN, the claim, the completion and COMMIT
-- cost it; the TID scan adds one system call (an lseek for the table's length, 1 to 2 us).
-- In the transaction begin() opened (not once()'s savepoint) it appends a guard too, a one-time
-- filter that fails the batch before its COMMIT when that transaction has ended and another is
-- open: one psycopg opened for the statements after the end, or another begin()'s
-- (_OWNED_GUARD in store/_async/keys.py).
UPDATE {schema}.keys
   SET completed_at = coalesce(%(now)s::timestamptz, completed_at, now()),
       response_status = %(status)s,
       response_headers = %(headers)s,
       response_body = %(body)s
 WHERE scope = %(scope)s AND key = %(key)s AND response_headers IS NULL

-- name: release
-- Frees a claim in the current transaction (a 5xx that is not stored): the next retry runs anew.
DELETE FROM {schema}.keys
 WHERE scope = %(scope)s AND key = %(key)s AND response_headers IS NULL
