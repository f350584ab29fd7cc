-- The inbox notifies only while a worker waits, as the outbox's enqueue does (outbox_waiting_relays).
--
-- inbox_store() sent pg_notify for every batch that stored an event. PostgreSQL serializes the
-- commits of the transactions that notified (one lock on the notification queue, held from
-- pre-commit to the end of the commit), so under load, when the workers are busy and hear
-- nothing new from a notification, every delivery's commit still queued behind the others'; the
-- "Database cost per request" table measured the stored, claimed and done event at 3.2 times a
-- bare queue's server CPU.
--
-- A worker loop that is about to sleep registers in inbox_waiting_workers, looks for events once
-- more (one committed just before the registration sent no notification) and unregisters when it
-- wakes; inbox_store() notifies only while a registration younger than a minute exists (a loop
-- that died waiting leaves one behind, which then stops counting). The workers' wake-up latency is
-- unchanged: a worker that sleeps is registered.

CREATE TABLE inbox_waiting_workers (
    worker text        NOT NULL,
    since  timestamptz NOT NULL,
    CONSTRAINT inbox_waiting_workers_pkey PRIMARY KEY (worker)
);

CREATE OR REPLACE FUNCTION inbox_store(p_source text[], p_event_id text[], p_body bytea[], p_headers jsonb[],
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

    -- Only while a worker waits (inbox_waiting_workers), as the outbox's enqueue does: the
    -- commits of notifying transactions are serialized, and busy workers need no wake-up.
    IF cardinality(v_stored) > 0
       AND EXISTS (SELECT 1 FROM inbox_waiting_workers
                    WHERE since > now() - interval '1 minute') THEN
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

