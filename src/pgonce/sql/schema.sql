-- pgonce: the full current schema. Numbered migrations in migrations/ build exactly this;
-- tests/test_migrations.py proves it. Names are unqualified: it is applied with search_path set
-- to pgonce's schema (default "pgonce").

-- Every function below takes `SET search_path FROM CURRENT`: pgonce's schema, then pg_temp
-- (0020). PostgreSQL searches the session's temporary schema for tables and types first unless
-- search_path names it; named last, a caller's temporary table called keys or inbox never stands
-- in for pgonce's. The schema's name is configurable, hence current_schema() rather than a name.
SELECT set_config('search_path', current_schema() || ', pg_temp', true);

-- ## Key store: one row per logical operation, keyed by (scope, key).
--
-- A claim is the row's INSERT; it commits in the caller's transaction together with the caller's
-- writes and the stored response, so a rolled-back transaction frees the key by itself.

-- Scopes and keys (key_text: an opaque identifier) are 1 to 512 bytes; a fingerprint is a SHA-256 digest. Domains rather than CHECK
-- constraints: a table's checks are planned again by every statement that writes a row (15 µs per
-- claim and 14 µs per completion on PostgreSQL 18), a domain's once per session, and only where a
-- value is stored into it.
CREATE DOMAIN key_text AS text
    CONSTRAINT key_text_length CHECK (octet_length(VALUE) BETWEEN 1 AND 512);
CREATE DOMAIN sha256_digest AS bytea
    CONSTRAINT sha256_digest_length CHECK (octet_length(VALUE) = 32);

CREATE TABLE keys (
    -- The caller, tenant or webhook source. It leads the primary key: it is the distribution column
    -- on Citus, and keys of two scopes never meet.
    -- Both compare as bytes ("C"): opaque identifiers need equality only, memcmp() is cheaper than
    -- the database's collation, and the index never depends on the C library's collation tables.
    scope            key_text    COLLATE "C" NOT NULL,
    key              key_text    COLLATE "C" NOT NULL,
    -- SHA-256 of the request. The same key with another fingerprint is a mismatch, never a replay.
    fingerprint      sha256_digest NOT NULL,
    claimed_at       timestamptz NOT NULL,
    -- Set in the same transaction as the response. A claim of a bare claim() has it NULL until
    -- then; a claim of begin() or once() is born with it (its transaction, or once()'s savepoint,
    -- stores the response or rolls back), so that its completion changes nothing an index reads
    -- and is a HOT update (0013).
    completed_at     timestamptz,
    response_status  integer,
    -- [[name, value], ...]: a JSON array keeps order and repeated names. NULL exactly while no
    -- response is stored: the completion always writes an array, if only [].
    response_headers jsonb,
    -- The body exactly as sent: bytea, not jsonb, because jsonb rewrites whitespace and key order
    -- and a replay must be byte-identical. The keys_readable view shows JSON bodies as jsonb.
    response_body    bytea,
    CONSTRAINT keys_pkey PRIMARY KEY (scope, key)
)
-- Room on each page for the completion's new version, which is longer by the response: a HOT
-- update needs it on the same page (0013).
WITH (fillfactor = 80);

-- Keys by completion (0019), read by three statements:
--   * the health check's stuck claims (completed_at IS NULL): the claims that never completed, the
--     only NULLs, found without reading the retained keys. Only a bare claim() and a two-phase
--     claim make one, whose caller may commit without a response. A claim of begin() or once() is
--     never one (it is born completed and commits with its response), unless its transaction was
--     committed by hand inside the block: a retry then reads it as in flight (no response stored),
--     and the sweeper removes it by age like a completed key.
--   * the sweeper's batches, which age a key by its completion (completed_at < the retention's
--     bound, oldest first): each reads exactly the rows it deletes, however large the table and
--     however few rows are due.
--   * the health check's retention figures: "the oldest completed key" is one index probe.
-- One plain index rather than a partial one for each side: every INSERT evaluates each partial
-- index's predicate and opens each index, though a row is in only one (callgrind, PostgreSQL 15,
-- one connection, python -m bench.instructions: a fresh key's claim, business insert and
-- completion by ctid 253,314 server instructions against 265,572 with the two; begin()'s claim
-- alone 154,402 against 162,493). Still one 8-byte entry per key. A completion of a claim born
-- completed changes nothing it reads and is a HOT update; a bare claim()'s completion sets
-- completed_at and adds the entry of its completion time. A BRIN index (0001's, dropped by 0008)
-- cannot serve the sweeper for long: its ranges only ever widen, and space freed by the sweeper
-- is reused by new keys, so old and new rows share every range.
CREATE INDEX keys_by_completion ON keys (completed_at);

-- claim(): the one statement of a claim.
--
-- INSERT ... ON CONFLICT DO NOTHING is the serialization point; nothing is read first. When another
-- transaction holds an uncommitted claim of the same key, the INSERT waits for it, at most p_wait_ms
-- (lock_timeout, restored when the function returns). Outcomes, as `state`:
--   won       the row is ours; the caller does the work.
--   existing  the key was committed by someone else; the row's columns are returned for the caller
--             to decide replay, mismatch or in flight (a committed claim that never completed).
--   locked    the original transaction was still open after p_wait_ms.
--   invisible the key was committed after this transaction's snapshot (REPEATABLE READ or
--             SERIALIZABLE): this transaction can never read it, a retry in a new one can.
--   gone      the conflicting row vanished before it could be read (released, or swept).
-- The EXCEPTION block is a subtransaction: a timeout leaves the caller's transaction usable. A
-- duplicate that finds a committed row writes nothing and takes no transaction id.
-- p_completed: the row is born with completed_at set, for a caller whose completion (or rollback)
-- is certain, so that the completion is a HOT update (see the keys table).
CREATE FUNCTION claim(p_scope text, p_key text, p_fingerprint bytea, p_wait_ms integer,
                      p_now timestamptz, p_completed boolean DEFAULT false)
RETURNS TABLE (state text, fingerprint bytea, claimed_at timestamptz, completed_at timestamptz,
               response_status integer, response_headers jsonb, response_body bytea)
LANGUAGE plpgsql
SET search_path FROM CURRENT  -- pgonce's schema, then pg_temp (top of this file)
SET lock_timeout = 2000
AS $claim$
DECLARE
    v_claimed_at timestamptz := coalesce(p_now, now());
BEGIN
    PERFORM set_config('lock_timeout', greatest(p_wait_ms, 1)::text, true);
    BEGIN
        INSERT INTO keys AS k (scope, key, fingerprint, claimed_at, completed_at)
        VALUES (p_scope, p_key, p_fingerprint, v_claimed_at,
                CASE WHEN p_completed THEN v_claimed_at END)
        ON CONFLICT (scope, key) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT 'won'::text, p_fingerprint, v_claimed_at, NULL::timestamptz,
                                NULL::integer, NULL::jsonb, NULL::bytea;
            RETURN;
        END IF;
    EXCEPTION
        WHEN lock_not_available THEN
            RETURN QUERY SELECT 'locked'::text, NULL::bytea, NULL::timestamptz, NULL::timestamptz,
                                NULL::integer, NULL::jsonb, NULL::bytea;
            RETURN;
        WHEN serialization_failure THEN
            RETURN QUERY SELECT 'invisible'::text, NULL::bytea, NULL::timestamptz, NULL::timestamptz,
                                NULL::integer, NULL::jsonb, NULL::bytea;
            RETURN;
    END;
    RETURN QUERY
        SELECT 'existing'::text, k.fingerprint::bytea, k.claimed_at, k.completed_at,
               k.response_status, k.response_headers, k.response_body
          FROM keys AS k
         WHERE k.scope = p_scope AND k.key = p_key;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'gone'::text, NULL::bytea, NULL::timestamptz, NULL::timestamptz,
                            NULL::integer, NULL::jsonb, NULL::bytea;
    END IF;
END
$claim$;

-- For people reading an incident: hex fingerprints, durations, and a printable start of each body
-- (encode(..., 'escape') never fails, whatever the bytes are).
CREATE VIEW keys_readable AS
SELECT scope, key, encode(fingerprint, 'hex') AS fingerprint, claimed_at, completed_at,
       completed_at - claimed_at AS duration, response_status, response_headers,
       octet_length(response_body) AS response_bytes,
       encode(substring(response_body FROM 1 FOR 200), 'escape') AS response_preview
  FROM keys;

-- ## Outbox: events written in the business transaction, published by the relay.
--
-- enqueue() inserts a row in the caller's transaction, so the event exists exactly when the
-- business write committed. The relay claims pending rows with FOR UPDATE SKIP LOCKED, publishes
-- them, and marks them published only after the broker acknowledged, in the claim's transaction.
-- The columns id, aggregatetype, aggregateid, type and payload are those Debezium's outbox event
-- router reads, so change data capture can take over from the relay without a data migration.

-- Names of 1 to 255 bytes, headers a JSON object, attempts never negative: domains, for the same
-- reason as the key store's (an enqueue with five CHECK constraints cost 33 µs in the database,
-- with these domains 24.5).
CREATE DOMAIN outbox_name AS text
    CONSTRAINT outbox_name_length CHECK (octet_length(VALUE) BETWEEN 1 AND 255);
CREATE DOMAIN outbox_headers AS jsonb
    CONSTRAINT outbox_headers_is_object CHECK (jsonb_typeof(VALUE) = 'object');
CREATE DOMAIN attempt_count AS integer
    CONSTRAINT attempt_count_not_negative CHECK (VALUE >= 0);

CREATE TABLE outbox (
    -- The message id on every broker (AMQP message-id, the Redis stream field, webhook-id; in
    -- Nats-Msg-Id after the outbox's origin or the publisher's prefix), so consumers and
    -- JetStream can drop redeliveries. Allocated by enqueue() only
    -- after it holds the aggregate's lock (outbox_aggregates), which makes the id order of one
    -- aggregate's rows their commit order (not for events enqueued with ordered=False, which
    -- take no lock). The sequence must keep CACHE 1 for that to hold.
    id              bigint      GENERATED ALWAYS AS IDENTITY,
    -- What the event is about: the topic family ("order") and the instance ("42"). Opaque, so
    -- they compare as bytes, as in outbox_aggregates (see keys.scope).
    aggregatetype   outbox_name COLLATE "C" NOT NULL,
    aggregateid     key_text    COLLATE "C" NOT NULL,
    -- The event's name ("order.created").
    type            outbox_name NOT NULL,
    payload         jsonb       NOT NULL,
    -- Extra message headers, {"name": "value"}; published with every delivery.
    headers         outbox_headers NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- NULL until a broker acknowledged the row; then the sweeper's clock (retention by age).
    published_at    timestamptz,
    -- Refused deliveries so far (a broker that is down does not count: its rows just wait).
    attempts        attempt_count NOT NULL DEFAULT 0,
    -- The relay takes a row only from this moment on (backoff after a refusal).
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    -- Dead letter: set after the configured attempts; replay() clears it.
    parked_at       timestamptz,
    -- aggregateid is the outbox's distribution column on Citus, so the key contains it (0012); id
    -- leads, for the lookups by id alone, and is unique by itself (GENERATED ALWAYS).
    CONSTRAINT outbox_pkey PRIMARY KEY (id, aggregateid)
);

-- The relay's scan: pending rows in id order.
CREATE INDEX outbox_pending ON outbox (id)
    WHERE published_at IS NULL AND parked_at IS NULL;

-- "Is there an older pending row of this aggregate?": the relay takes only an aggregate's oldest.
CREATE INDEX outbox_pending_aggregate ON outbox (aggregatetype, aggregateid, id)
    WHERE published_at IS NULL AND parked_at IS NULL;

-- The sweeper deletes published rows by published_at.
CREATE INDEX outbox_published_at ON outbox (published_at)
    WHERE published_at IS NOT NULL;

-- The dead letters by aggregate (0010): replay() reads them all or one aggregate type's; the
-- sweeper probes an idle aggregate for them before it deletes its lock row.
CREATE INDEX outbox_parked ON outbox (aggregatetype, aggregateid)
    WHERE parked_at IS NOT NULL AND published_at IS NULL;

-- One row per aggregate that ever had an event. enqueue() upserts it first: the row lock, held to
-- commit, serializes the transactions that write events of one aggregate, so a later transaction
-- allocates its outbox id only after the earlier one committed or rolled back. The contents are
-- for people; the sweeper may delete a row at any time (the next enqueue recreates it). Unlogged
-- (0014): the lock is what counts, and it lives in memory; the rows cost no WAL, and a crash or a
-- promotion empties the table when no transaction can hold one of its locks.
CREATE UNLOGGED TABLE outbox_aggregates (
    aggregatetype    text        COLLATE "C" NOT NULL,
    -- The outbox's type (0012): the two tables are co-located on Citus, by this column.
    aggregateid      key_text    COLLATE "C" NOT NULL,
    events           bigint      NOT NULL,
    -- The last enqueue, to the hour: enqueue() moves it only when it is an hour behind (0018).
    last_enqueued_at timestamptz NOT NULL,
    CONSTRAINT outbox_aggregates_pkey PRIMARY KEY (aggregatetype, aggregateid)
)
-- Room on each page for the HOT update of a known aggregate's row (0018): enqueue() moves
-- last_enqueued_at, the one indexed column it sets, only when it is an hour behind.
WITH (fillfactor = 80);

-- Relays waiting for a notification, each refreshing its row whenever it goes back to sleep.
-- enqueue() sends NOTIFY only while a relay waits: PostgreSQL serializes the commits of all
-- transactions that notified (one lock on the notification queue, held from pre-commit to the
-- end of the commit), so notifying while the relays are busy anyway would turn every concurrent
-- business commit into a queue. A row older than a minute belongs to a relay that died waiting.
CREATE TABLE outbox_waiting_relays (
    relay text        NOT NULL,
    since timestamptz NOT NULL,
    CONSTRAINT outbox_waiting_relays_pkey PRIMARY KEY (relay)
);

-- outbox_enqueue(): enqueue() of pgonce before 0014 (kept for its callers during an upgrade);
-- returns the new row's id. enqueue() now runs the same steps as one plain statement (the queries'
-- enqueue), without the cost of a PL/pgSQL call.
--
-- Takes the aggregate's lock, inserts the row, and, while a relay waits, notifies p_channel
-- ("<schema>_outbox"). NOTIFY is delivered at commit, never for a rolled-back transaction, and
-- the identical payload is sent once per transaction however many rows it enqueued.
CREATE FUNCTION outbox_enqueue(p_aggregatetype text, p_aggregateid text, p_type text,
                               p_payload jsonb, p_headers jsonb, p_now timestamptz,
                               p_channel text)
RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT  -- pgonce's schema, then pg_temp (top of this file)
AS $enqueue$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_id  bigint;
BEGIN
    INSERT INTO outbox_aggregates AS a (aggregatetype, aggregateid, events, last_enqueued_at)
    VALUES (p_aggregatetype, p_aggregateid, 1, v_now)
    ON CONFLICT (aggregatetype, aggregateid)
    DO UPDATE SET events = a.events + 1, last_enqueued_at = v_now;
    INSERT INTO outbox (aggregatetype, aggregateid, type, payload, headers, created_at,
                        next_attempt_at)
    VALUES (p_aggregatetype, p_aggregateid, p_type, p_payload, coalesce(p_headers, '{}'), v_now,
            v_now)
    RETURNING id INTO v_id;
    -- The real clock, not p_now: staleness is about relays that exist now.
    IF EXISTS (SELECT 1 FROM outbox_waiting_relays WHERE since > now() - interval '1 minute') THEN
        PERFORM pg_notify(p_channel, '');
    END IF;
    RETURN v_id;
END
$enqueue$;

-- ## Webhook inbox: one row per verified delivery, keyed by (source, event_id).
--
-- A delivery is stored raw and acknowledged once its row committed; workers then claim pending rows
-- with FOR UPDATE SKIP LOCKED and run the source's handler in the transaction that marks the row
-- done, so the handler's writes and the row's new status commit together or not at all.

CREATE TABLE inbox (
    -- The configured source name. It leads the primary key: it is the distribution column on
    -- Citus, and events of two sources never meet. Source, event id and ordering key compare as
    -- bytes, as in inbox_watermarks (see keys.scope): inbox_pkey is the dedupe.
    source           text        COLLATE "C" NOT NULL,
    -- The provider's event id (or a hash of retry-stable fields when the provider sends none).
    event_id         text        COLLATE "C" NOT NULL,
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
    ordering_key     text        COLLATE "C",
    -- The object's version (or timestamp) for the out-of-order policy 'drop'.
    version          bigint,
    processed_at     timestamptz,
    CONSTRAINT inbox_pkey PRIMARY KEY (source, event_id),
    CONSTRAINT inbox_source_valid CHECK (octet_length(source) BETWEEN 1 AND 200),
    CONSTRAINT inbox_event_id_valid CHECK (octet_length(event_id) BETWEEN 1 AND 512),
    CONSTRAINT inbox_digest_sha256 CHECK (octet_length(digest) = 32),
    CONSTRAINT inbox_status_valid CHECK (status IN ('pending', 'done', 'dead', 'skipped')),
    CONSTRAINT inbox_processed_when_final CHECK ((status = 'pending') = (processed_at IS NULL))
)
-- Room on each page for the done mark's new version: on the row's own page it is WAL-logged as
-- its difference from the old one, without the body (0013).
WITH (fillfactor = 80);

-- The worker's claim, one source at a time: its pending rows in next_attempt_at order. Finished
-- rows are not in the index, and other sources' backlogs are not in the way (on Citus the claim
-- stays on one shard).
CREATE INDEX inbox_pending ON inbox (source, next_attempt_at) WHERE status = 'pending';

-- The ordering check: "is there an earlier unfinished event with my ordering key?"
CREATE INDEX inbox_ordering ON inbox (source, ordering_key, received_at, seq)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'dead');

-- Dead letters by source (0011): the metrics count them and replay() reads them, without reading
-- the handled events of the retention.
CREATE INDEX inbox_dead ON inbox (source, received_at) WHERE status = 'dead';

-- The last applied version per (source, ordering key), for the out-of-order policy 'drop'. It is
-- advanced in the handler's transaction: a handler that fails leaves it where it was.
CREATE TABLE inbox_watermarks (
    source       text        COLLATE "C" NOT NULL,
    ordering_key text        COLLATE "C" NOT NULL,
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
-- per call, and only when something was stored while a worker waits (0017), wakes the workers.
CREATE FUNCTION inbox_store(p_source text[], p_event_id text[], p_body bytea[], p_headers jsonb[],
                            p_digest bytea[], p_ordering_key text[], p_version bigint[],
                            p_now timestamptz, p_channel text)
RETURNS TABLE (ord integer, outcome text)
LANGUAGE plpgsql
SET search_path FROM CURRENT  -- pgonce's schema, then pg_temp (top of this file)
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

-- Inbox worker loops waiting for a notification (0017), each registered while it sleeps.
-- inbox_store() notifies only while one is registered, for the reason outbox_waiting_relays gives;
-- a row older than a minute belongs to a loop that died waiting.
CREATE TABLE inbox_waiting_workers (
    worker text        NOT NULL,
    since  timestamptz NOT NULL,
    CONSTRAINT inbox_waiting_workers_pkey PRIMARY KEY (worker)
);

-- For people reading an incident: sizes, hex digests and a printable start of each body.
CREATE VIEW inbox_readable AS
SELECT source, event_id, status, attempts, received_at, next_attempt_at, processed_at,
       processed_at - received_at AS latency, last_error, ordering_key, version,
       encode(digest, 'hex') AS digest, octet_length(body) AS body_bytes,
       encode(substring(body FROM 1 FOR 200), 'escape') AS body_preview
  FROM inbox;

-- ## Sweeper paths through the inbox and the outbox (0005)
--
-- A batch reads the rows it deletes, oldest first, never the table.

-- Handled deliveries by age. Dead letters are not in it: they wait for a person (and a replay).
CREATE INDEX inbox_finished_by_age ON inbox (received_at) WHERE status IN ('done', 'skipped');

-- Aggregates by the time of their last enqueue: an idle aggregate's lock row can go.
CREATE INDEX outbox_aggregates_by_age ON outbox_aggregates (last_enqueued_at);

-- ## What the sweeper deleted (0015)
--
-- Per target and scope, the newest age-column value a sweep batch deleted and how many rows it
-- deleted, noted in the same statement as the DELETE: health tells a young table (nothing deleted
-- that a sender may still retry) from early deletion (a deleted row younger than the retry
-- horizon). `newest` only grows, so it stays one row per target and scope. '' is the scope of
-- tables without one. Deletions outside the sweeper are not noted.
CREATE TABLE sweep_marks (
    target      text        COLLATE "C" NOT NULL,
    scope       text        COLLATE "C" NOT NULL,
    deleted     bigint      NOT NULL,
    newest      timestamptz NOT NULL,
    swept_at    timestamptz NOT NULL,
    CONSTRAINT sweep_marks_pkey PRIMARY KEY (target, scope)
);

-- ## Two-phase keys: leases, fencing tokens and recovery points (0016)
--
-- A two-phase claim commits at once: the keys row (completed_at NULL: every duplicate reads it as
-- in flight) and its lease row here. Each phase is a short transaction that locks the lease row
-- by its token, does its writes and records the point reached; the last one stores the response
-- and deletes the lease row. A side table, so the one-transaction path never touches it. Tokens
-- come from one sequence: they only grow for a key, even across a sweep and a reuse of the key.
CREATE SEQUENCE key_lease_tokens;

CREATE TABLE key_leases (
    scope        key_text    COLLATE "C" NOT NULL,
    key          key_text    COLLATE "C" NOT NULL,
    -- The current holder's fencing token; a takeover replaces it with a larger one.
    token        bigint      NOT NULL,
    -- Past it, a retry or the completer may take the key over; a heartbeat moves it on.
    locked_until timestamptz NOT NULL,
    -- The registered operation the completer runs, with its arguments (NULL: retries only).
    operation    text        COLLATE "C",
    args         jsonb       NOT NULL,
    -- The last recovery point reached (NULL: none yet) and the state the phases recorded.
    point        text        COLLATE "C",
    state        jsonb       NOT NULL,
    -- Holders so far (the first claim and each takeover), and the last failure of one.
    attempts     integer     NOT NULL,
    last_error   text,
    CONSTRAINT key_leases_pkey PRIMARY KEY (scope, key)
);

-- Leases by expiry: the completer's search and the health check's stuck phases.
CREATE INDEX key_leases_expired ON key_leases (locked_until);
