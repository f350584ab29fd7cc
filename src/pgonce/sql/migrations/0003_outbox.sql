-- ## Outbox: events written in the business transaction, published by the relay.
--
-- enqueue() inserts a row in the caller's transaction, so the event exists exactly when the
-- business write committed. The relay claims pending rows with FOR UPDATE SKIP LOCKED, publishes
-- them, and marks them published only after the broker acknowledged, in the claim's transaction.
-- The columns id, aggregatetype, aggregateid, type and payload are those Debezium's outbox event
-- router reads, so change data capture can take over from the relay without a data migration.

CREATE TABLE outbox (
    -- The message id on every broker (AMQP message-id, Nats-Msg-Id, the Redis stream field,
    -- webhook-id), so consumers and JetStream can drop redeliveries. Allocated by enqueue() only
    -- after it holds the aggregate's lock (outbox_aggregates), which makes the id order of one
    -- aggregate's rows their commit order. The sequence must keep CACHE 1 for that to hold.
    id              bigint      GENERATED ALWAYS AS IDENTITY,
    -- What the event is about: the topic family ("order") and the instance ("42").
    aggregatetype   text        NOT NULL,
    aggregateid     text        NOT NULL,
    -- The event's name ("order.created").
    type            text        NOT NULL,
    payload         jsonb       NOT NULL,
    -- Extra message headers, {"name": "value"}; published with every delivery.
    headers         jsonb       NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- NULL until a broker acknowledged the row; then the sweeper's clock (retention by age).
    published_at    timestamptz,
    -- Refused deliveries so far (a broker that is down does not count: its rows just wait).
    attempts        integer     NOT NULL DEFAULT 0,
    -- The relay takes a row only from this moment on (backoff after a refusal).
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    -- Dead letter: set after the configured attempts; replay() clears it.
    parked_at       timestamptz,
    CONSTRAINT outbox_pkey PRIMARY KEY (id),
    CONSTRAINT outbox_aggregatetype_valid CHECK (octet_length(aggregatetype) BETWEEN 1 AND 255),
    CONSTRAINT outbox_aggregateid_valid CHECK (octet_length(aggregateid) BETWEEN 1 AND 512),
    CONSTRAINT outbox_type_valid CHECK (octet_length(type) BETWEEN 1 AND 255),
    CONSTRAINT outbox_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    CONSTRAINT outbox_attempts_valid CHECK (attempts >= 0)
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

-- The dead letters, for health checks and replay.
CREATE INDEX outbox_parked_at ON outbox (parked_at)
    WHERE parked_at IS NOT NULL;

-- One row per aggregate that ever had an event. enqueue() upserts it first: the row lock, held to
-- commit, serializes the transactions that write events of one aggregate, so a later transaction
-- allocates its outbox id only after the earlier one committed or rolled back. The contents are
-- for people; the sweeper may delete a row at any time (the next enqueue recreates it).
CREATE TABLE outbox_aggregates (
    aggregatetype    text        NOT NULL,
    aggregateid      text        NOT NULL,
    events           bigint      NOT NULL,
    last_enqueued_at timestamptz NOT NULL,
    CONSTRAINT outbox_aggregates_pkey PRIMARY KEY (aggregatetype, aggregateid)
);

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

-- outbox_enqueue(): the one statement of enqueue(); returns the new row's id.
--
-- Takes the aggregate's lock, inserts the row, and, while a relay waits, notifies p_channel
-- ("<schema>_outbox"). NOTIFY is delivered at commit, never for a rolled-back transaction, and
-- the identical payload is sent once per transaction however many rows it enqueued.
CREATE FUNCTION outbox_enqueue(p_aggregatetype text, p_aggregateid text, p_type text,
                               p_payload jsonb, p_headers jsonb, p_now timestamptz,
                               p_channel text)
RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
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
