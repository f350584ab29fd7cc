-- The sweeper's paths through the inbox and the outbox: a batch reads the rows it deletes, oldest
-- first, never the table.

-- Handled deliveries by age. Dead letters are not in it: they wait for a person (and a replay).
CREATE INDEX inbox_finished_by_age ON inbox (received_at) WHERE status IN ('done', 'skipped');

-- Aggregates by the time of their last enqueue: an idle aggregate's lock row can go.
CREATE INDEX outbox_aggregates_by_age ON outbox_aggregates (last_enqueued_at);
