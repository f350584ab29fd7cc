-- One index on keys (completed_at) instead of the two partial indexes on claimed_at.
--
-- keys_incomplete (claimed_at) WHERE completed_at IS NULL served the health check's stuck
-- claims; keys_completed_by_age (claimed_at) WHERE completed_at IS NOT NULL served the sweeper's
-- batches and the health check's retention figures. Every INSERT into keys evaluated both
-- predicates and opened both indexes, though a row has an entry in only one of them. One plain
-- index on completed_at serves all three readers: its NULLs are the claims that never completed
-- (a bare claim()'s until its completion, a two-phase claim's until its last phase), found by
-- `completed_at IS NULL` without reading the retained keys; its non-NULL values are the completed
-- keys in age order, which each sweep batch reads oldest first. A row still has one 8-byte entry.
-- callgrind, PostgreSQL 15, one connection (python -m bench.instructions): a fresh key's claim,
-- business insert and completion by ctid cost the server 265,572 instructions before, 253,314
-- after (-4.6 %); begin()'s claim alone 162,493 before, 154,402 after; once() with its queued
-- insert 278,199 before, 264,128 after (two runs of the same code differ by at most 1,500).
--
-- A completion that keeps completed_at (begin()'s and once()'s claims are born with it, 0013)
-- changes nothing the index reads and stays a HOT update. A bare claim()'s completion sets it:
-- a new entry, as its move between the two partial indexes was.
--
-- The sweeper now ages a key by completed_at rather than claimed_at: the same moment for the
-- claims of begin() and once(), which are born completed; for a bare claim() or a two-phase
-- request, the time its response was stored, so a key is kept its retention after its answer
-- (never shorter than before). sweep_marks.newest of keys then notes completion times; the
-- values noted before it are claim times, earlier or equal, so health's early-deletion check
-- reads them as it did.
--
-- Cost on a large table: CREATE INDEX reads the whole table once and sorts its completed_at
-- values (PostgreSQL 15, a million keys of 400 bytes, table in memory: 0.35 to 0.45 s). The two
-- DROP INDEX lock the table first, exclusively, so claims and replays wait for the build; the
-- lock is taken before the build rather than after it, so that no transaction can deadlock with
-- the migration over it. On a table of many millions of keys, run it in a quiet minute. No key
-- is rewritten.

DROP INDEX keys_incomplete;
DROP INDEX keys_completed_by_age;

CREATE INDEX keys_by_completion ON keys (completed_at);
