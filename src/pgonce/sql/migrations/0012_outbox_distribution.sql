-- The outbox ready for a distributed PostgreSQL (Citus), where the aggregate's id is the outbox's
-- distribution column (pgonce.sql.distribution, docs/concepts/beyond-one-primary.md).
--
-- The primary key carries aggregateid: a distributed table's unique keys must contain its
-- distribution column. id stays first, so every lookup by id alone (the relay's marks, replay)
-- still descends this index; id alone stays unique as before (an identity, GENERATED ALWAYS).
-- Rebuilds the index under an exclusive lock on the outbox: brief where the sweeper keeps the
-- outbox to its pending and recently published rows.
ALTER TABLE outbox
    DROP CONSTRAINT outbox_pkey,
    ADD CONSTRAINT outbox_pkey PRIMARY KEY (id, aggregateid);

-- outbox_aggregates.aggregateid takes the outbox's type: enqueue() writes both tables in one
-- transaction, and Citus co-locates (keeps rows of equal value on one node) only tables whose
-- distribution columns have the same type and collation; text and the domain key_text are two
-- types. The same values were accepted: enqueue() stores each one in outbox.aggregateid too.
ALTER TABLE outbox_aggregates
    ALTER COLUMN aggregateid TYPE key_text COLLATE "C";
