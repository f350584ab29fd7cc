-- ## Webhook inbox: one row per verified delivery, keyed by (source, event_id).
--
-- A delivery is stored raw and acknowledged once its row committed; workers then claim pending rows
-- with FOR UPDATE SKIP LOCKED and run the source's handler in the transaction that marks the row
-- done, so the handler's writes and the row's new status commit together or not at all.

CREATE TABLE inbox (
    -- The configured source name. It leads the primary key: it is the distribution column on
    -- Citus, and events of two sources never meet.
    source           text        NOT NULL,
    -- The provider's event id (or a hash of retry-stable fields when the provider sends none).
    event_id         text        NOT NULL,
    -- Arrival order among events of one ordering key (ties of received_at inside one commit).
    seq              bigint      GENERATED ALWAYS AS IDENTITY,
    -- The body exactly as received: the signature was computed over these bytes.
    body             bytea       NOT NULL,
    -- {name: value} of the request headers (lower-case names), enough to verify the delivery again.
    headers          jsonb       NOT NULL,
    -- SHA-256 of body: the same event id with another digest is a conflict, never a duplicate.
    digest           bytea       NOT NULL,
    received_at      timestamptz NOT NULL,
    status           text        NOT NULL DEFAULT 'pending',
    -- Failed handler runs (the dead-letter count); a run cut short by a crash is not counted.
    attempts         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL,
    -- "<exception type>: <message>", truncated; the handler's last failure.
    last_error       text,
    -- Events with the same ordering key are processed one at a time, in arrival order.
    ordering_key     text,
    -- The object's version (or timestamp) for the out-of-order policy 'drop'.
    version          bigint,
    processed_at     timestamptz,
    CONSTRAINT inbox_pkey PRIMARY KEY (source, event_id),
    CONSTRAINT inbox_source_valid CHECK (octet_length(source) BETWEEN 1 AND 200),
    CONSTRAINT inbox_event_id_valid CHECK (octet_length(event_id) BETWEEN 1 AND 512),
    CONSTRAINT inbox_digest_sha256 CHECK (octet_length(digest) = 32),
    CONSTRAINT inbox_status_valid CHECK (status IN ('pending', 'done', 'dead', 'skipped')),
    CONSTRAINT inbox_processed_when_final CHECK ((status = 'pending') = (processed_at IS NULL))
);

-- The worker's claim, one source at a time: its pending rows in next_attempt_at order. Finished
-- rows are not in the index, and other sources' backlogs are not in the way (on Citus the claim
-- stays on one shard).
CREATE INDEX inbox_pending ON inbox (source, next_attempt_at) WHERE status = 'pending';

-- The ordering check: "is there an earlier unfinished event with my ordering key?"
CREATE INDEX inbox_ordering ON inbox (source, ordering_key, received_at, seq)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'dead');

-- The sweeper deletes by age; rows arrive in received_at order, so a BRIN index is enough.
CREATE INDEX inbox_received_at_brin ON inbox USING brin (received_at);

-- The last applied version per (source, ordering key), for the out-of-order policy 'drop'. It is
-- advanced in the handler's transaction: a handler that fails leaves it where it was.
CREATE TABLE inbox_watermarks (
    source       text        NOT NULL,
    ordering_key text        NOT NULL,
    version      bigint      NOT NULL,
    event_id     text        NOT NULL,
    updated_at   timestamptz NOT NULL,
    CONSTRAINT inbox_watermarks_pkey PRIMARY KEY (source, ordering_key)
);

-- inbox_store(): the one statement that stores a batch of deliveries.
--
-- INSERT ... ON CONFLICT DO NOTHING claims each (source, event_id); nothing is read first. Only the
-- deliveries that conflicted are then read back (a new statement, so a row committed by a
-- concurrent transaction while we waited for it is visible) to tell a duplicate (same digest) from
-- a conflict (another digest). Outcomes, by position in the input (1-based):
--   stored     the row is new; it commits with this transaction.
--   duplicate  the event was already stored with the same body.
--   conflict   the event id was already stored with another body.
--   gone       the conflicting row vanished before it could be read (swept): retry later.
-- Rows are inserted in key order so that two concurrent batches cannot deadlock. One pg_notify
-- per call, and only when something was stored, wakes the workers.
CREATE FUNCTION inbox_store(p_source text[], p_event_id text[], p_body bytea[], p_headers jsonb[],
                            p_digest bytea[], p_ordering_key text[], p_version bigint[],
                            p_now timestamptz, p_channel text)
RETURNS TABLE (ord integer, outcome text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $inbox_store$
DECLARE
    v_now    timestamptz := coalesce(p_now, now());
    v_stored integer[];
BEGIN
    WITH input AS (
        SELECT t.*
          FROM unnest(p_source, p_event_id, p_body, p_headers, p_digest, p_ordering_key, p_version)
               WITH ORDINALITY AS t(source, event_id, body, headers, digest, ordering_key, version, ord)
    ), firsts AS (
        SELECT DISTINCT ON (source, event_id) * FROM input ORDER BY source, event_id, ord
    ), inserted AS (
        INSERT INTO inbox (source, event_id, body, headers, digest, received_at, next_attempt_at,
                           ordering_key, version)
        SELECT source, event_id, body, headers, digest, v_now, v_now, ordering_key, version
          FROM firsts
         ORDER BY source, event_id
        ON CONFLICT (source, event_id) DO NOTHING
        RETURNING source, event_id
    )
    SELECT coalesce(array_agg(f.ord::integer), '{}')
      INTO v_stored
      FROM firsts AS f JOIN inserted AS i USING (source, event_id);

    IF cardinality(v_stored) > 0 THEN
        PERFORM pg_notify(p_channel, '');
    END IF;

    RETURN QUERY
        SELECT s.ord, 'stored'::text FROM unnest(v_stored) AS s(ord);
    RETURN QUERY
        SELECT t.ord::integer,
               CASE WHEN i.digest IS NULL THEN 'gone'
                    WHEN i.digest = t.digest THEN 'duplicate'
                    ELSE 'conflict' END
          FROM unnest(p_source, p_event_id, p_digest) WITH ORDINALITY AS t(source, event_id, digest, ord)
          LEFT JOIN inbox AS i ON i.source = t.source AND i.event_id = t.event_id
         WHERE t.ord::integer <> ALL (v_stored);
END
$inbox_store$;

-- For people reading an incident: sizes, hex digests and a printable start of each body.
CREATE VIEW inbox_readable AS
SELECT source, event_id, status, attempts, received_at, next_attempt_at, processed_at,
       processed_at - received_at AS latency, last_error, ordering_key, version,
       encode(digest, 'hex') AS digest, octet_length(body) AS body_bytes,
       encode(substring(body FROM 1 FOR 200), 'escape') AS body_preview
  FROM inbox;
