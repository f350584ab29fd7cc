-- What the sweeper deleted, so that health can tell a young table from early deletion.
--
-- The health check warned "the oldest row is younger than the retry horizon" on every new
-- deployment for as long as the horizon (three days by default), though nothing was deleted: a
-- young table and a sweeper that deletes too early leave the same oldest row. Each sweep batch now
-- notes, per target and scope, the newest age-column value it deleted (claimed_at of keys,
-- received_at of the inbox, published_at of the outbox, last_enqueued_at of an aggregate's lock
-- row) and how many rows it deleted, in the same statement as the DELETE.
--
-- A row created at `newest` was deleted; if `newest` is less than the retry horizon ago, a sender
-- may still retry it and the retry would run again: early deletion, proven and still live. When
-- no such row was deleted, a young oldest row is only a young table (or a quiet spell).
-- `newest` only grows (greatest of the old and new value), so the note is a single row per target
-- and scope however long the service runs; a concurrent sweeper batch that deletes rows of the
-- same scope waits for this one's commit at this row only (milliseconds).
-- Deletions outside the sweeper (a manual DELETE) are not noted.
CREATE TABLE sweep_marks (
    -- pgonce.core.retention.TARGETS: keys, inbox, outbox, outbox_aggregates.
    target      text        COLLATE "C" NOT NULL,
    -- The scope (keys) or source (inbox) of the deleted rows; '' for tables without one.
    scope       text        COLLATE "C" NOT NULL,
    -- Rows deleted so far.
    deleted     bigint      NOT NULL,
    -- The youngest deleted row's age column: the newest claimed_at, received_at, ... deleted.
    newest      timestamptz NOT NULL,
    -- When the last batch that deleted rows of this scope ran (the sweeper's clock).
    swept_at    timestamptz NOT NULL,
    CONSTRAINT sweep_marks_pkey PRIMARY KEY (target, scope)
);
