-- Two-phase keys: a lease with a fencing token, and the recovery point a request reached.
--
-- A request that must call a third party and answer with its result cannot keep one transaction
-- open across the call. In two-phase mode its claim commits at once (the keys row, completed_at
-- NULL, so every duplicate reads it as in flight) together with a lease row here; each phase of
-- the request is then a short transaction of its own that records the point reached, and the
-- final one stores the response and deletes the lease row.
--
-- A side table, not columns of keys: the one-transaction path never reads or writes it, so its
-- claims and completions cost what they cost before (no wider rows, no new index entry).
--
-- Every write of a holder names its token and locks this row first: a holder whose lease was
-- taken over (a larger token) writes nothing. Tokens come from one sequence, so they only grow for
-- a key even when its row is swept and the key is used again.
CREATE SEQUENCE key_lease_tokens;

CREATE TABLE key_leases (
    -- The key's scope and key (keys' primary key): scope leads, as the distribution column.
    scope        key_text    COLLATE "C" NOT NULL,
    key          key_text    COLLATE "C" NOT NULL,
    -- The current holder's fencing token; a takeover replaces it with a larger one.
    token        bigint      NOT NULL,
    -- The holder owns the key until then; a heartbeat moves it on. Past it, a retry or the
    -- completer may take the key over.
    locked_until timestamptz NOT NULL,
    -- The registered operation the completer runs to finish the request, with its arguments;
    -- NULL: only a client's retry finishes it.
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

-- Leases by expiry: the completer's search for abandoned requests and the health check's stuck
-- phases read only the expired ones.
CREATE INDEX key_leases_expired ON key_leases (locked_until);
