-- The inbox's and the outbox's identifiers compare as bytes too, as the key store's do since 0008.
--
-- A webhook source and event id, an ordering key, an aggregate's type and id are opaque: only
-- equality matters. Under "C" the indexes compare with memcmp() instead of the database's
-- collation, and no longer depend on the C library's collation tables, whose changes between
-- operating system releases silently corrupt text indexes: inbox_pkey is the webhook inbox's
-- dedupe, and a corrupt one could store and handle a redelivered event twice. Equality is
-- unchanged for every value (a deterministic collation compares equal exactly equal bytes).
--
-- Tables whose columns meet in a join change together: an index serves a comparison only under
-- its own collation (the relay's and the sweeper's outbox <-> outbox_aggregates joins).
--
-- Rebuilds inbox_pkey, inbox_pending, inbox_ordering, inbox_watermarks_pkey, outbox_aggregates_pkey
-- and outbox_pending_aggregate under exclusive locks: on large tables, run it in a quiet minute.

-- The view reads columns whose collation changes: set aside while they do.
DROP VIEW inbox_readable;

ALTER TABLE inbox
    ALTER COLUMN source TYPE text COLLATE "C",
    ALTER COLUMN event_id TYPE text COLLATE "C",
    ALTER COLUMN ordering_key TYPE text COLLATE "C";

ALTER TABLE inbox_watermarks
    ALTER COLUMN source TYPE text COLLATE "C",
    ALTER COLUMN ordering_key TYPE text COLLATE "C";

ALTER TABLE outbox
    ALTER COLUMN aggregatetype TYPE outbox_name COLLATE "C",
    ALTER COLUMN aggregateid TYPE key_text COLLATE "C";

ALTER TABLE outbox_aggregates
    ALTER COLUMN aggregatetype TYPE text COLLATE "C",
    ALTER COLUMN aggregateid TYPE text COLLATE "C";

CREATE VIEW inbox_readable AS
SELECT source, event_id, status, attempts, received_at, next_attempt_at, processed_at,
       processed_at - received_at AS latency, last_error, ordering_key, version,
       encode(digest, 'hex') AS digest, octet_length(body) AS body_bytes,
       encode(substring(body FROM 1 FOR 200), 'escape') AS body_preview
  FROM inbox;
