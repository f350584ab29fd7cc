-- Dead letters indexed by aggregate, so that the sweeper of idle aggregates never reads the outbox.
--
-- The sweeper deletes an aggregate's lock row only when none of its rows is left to publish,
-- pending or parked. Asked as one question (`published_at IS NULL`) it matched no index, and each
-- of its batches read the whole outbox, the published rows of the whole retention included (19 ms
-- a batch at 200,000 rows, growing with the outbox). Asked as two, pending rows are a probe of
-- outbox_pending_aggregate, and parked ones a probe of this index. replay() reads it as it read
-- the old one (all dead letters, or one aggregate type's). Only dead letters are in it: like the old
-- one, it takes an entry when a row is parked, loses it at replay, and otherwise costs each write
-- a look at its predicate.

DROP INDEX outbox_parked_at;

CREATE INDEX outbox_parked ON outbox (aggregatetype, aggregateid)
    WHERE parked_at IS NOT NULL AND published_at IS NULL;
