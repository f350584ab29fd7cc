-- The sweeper and the health check: completed keys in age order.
--
-- Applied with search_path set to pgonce's schema, so names here are unqualified.

-- Completed keys by claimed_at: each sweep batch reads exactly the rows it deletes, oldest first,
-- however large the table and however few rows are due; "the oldest completed key" of the health
-- check is one index probe. The BRIN index cannot do either for long: its ranges only ever widen,
-- and space freed by the sweeper is reused by new keys, so old and new rows share every range.
-- Partial, so a claim's INSERT (completed_at still NULL) does not touch it; the completion's
-- UPDATE adds one entry (it is never a HOT update: keys_incomplete's predicate reads completed_at).
CREATE INDEX keys_completed_by_age ON keys (claimed_at) WHERE completed_at IS NOT NULL;
