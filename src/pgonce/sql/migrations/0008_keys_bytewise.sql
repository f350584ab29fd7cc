-- The key store's identifiers compare as bytes, and two indexes that nothing reads are dropped.
--
-- Scopes and keys are opaque identifiers: only equality matters, and their order in the primary
-- key is nobody's business. Under the database's collation (en_US.UTF-8, or libc's C.UTF-8) every
-- comparison of the index's descent went through strcoll(); under "C" it is memcmp(). Two
-- reasons: each claim's primary-key entry costs less (callgrind, PostgreSQL 18, one connection:
-- 12,000 fewer server instructions a claim, of about 245,000 for a claim and its completion), and
-- the index no longer depends on the C library's collation tables, whose changes between
-- operating system releases silently corrupt text indexes (a duplicate key could then be
-- claimed twice). Equality is unchanged for every key: a deterministic collation compares equal
-- exactly the strings with equal bytes.
--
-- The BRIN indexes on keys.claimed_at and inbox.received_at served the sweeper until 0004 and
-- 0005 gave it partial indexes by age (keys_completed_by_age, inbox_finished_by_age); since then
-- no statement reads them, and every claim and every stored delivery paid for an entry in them
-- (12,000 to 17,000 server instructions a claim).
--
-- Changing the columns' collation rebuilds the primary key (an exclusive lock while it does): on
-- a large table, run this migration in a quiet minute.

DROP INDEX keys_claimed_at_brin;
DROP INDEX inbox_received_at_brin;

-- The view reads the columns whose collation changes: set aside while they do.
DROP VIEW keys_readable;

ALTER TABLE keys
    ALTER COLUMN scope TYPE key_text COLLATE "C",
    ALTER COLUMN key TYPE key_text COLLATE "C";

CREATE VIEW keys_readable AS
SELECT scope, key, encode(fingerprint, 'hex') AS fingerprint, claimed_at, completed_at,
       completed_at - claimed_at AS duration, response_status, response_headers,
       octet_length(response_body) AS response_bytes,
       encode(substring(response_body FROM 1 FOR 200), 'escape') AS response_preview
  FROM keys;
