-- The key store: one row per logical operation, keyed by (scope, key).
--
-- Applied with search_path set to pgonce's schema, so names here are unqualified.
-- A claim is the row's INSERT; it commits in the caller's transaction together with the caller's
-- writes and the stored response, so a rolled-back transaction frees the key by itself.

CREATE TABLE keys (
    -- The caller, tenant or webhook source. It leads the primary key: it is the distribution column
    -- on Citus, and keys of two scopes never meet.
    scope            text        NOT NULL,
    key              text        NOT NULL,
    -- SHA-256 of the request. The same key with another fingerprint is a mismatch, never a replay.
    fingerprint      bytea       NOT NULL,
    claimed_at       timestamptz NOT NULL,
    -- NULL while the claim is in flight; set in the same transaction as the response.
    completed_at     timestamptz,
    response_status  integer,
    -- [[name, value], ...]: a JSON array keeps order and repeated names.
    response_headers jsonb,
    -- The body exactly as sent: bytea, not jsonb, because jsonb rewrites whitespace and key order
    -- and a replay must be byte-identical. The keys_readable view shows JSON bodies as jsonb.
    response_body    bytea,
    CONSTRAINT keys_pkey PRIMARY KEY (scope, key),
    CONSTRAINT keys_scope_valid CHECK (octet_length(scope) BETWEEN 1 AND 512),
    CONSTRAINT keys_key_valid CHECK (octet_length(key) BETWEEN 1 AND 512),
    CONSTRAINT keys_fingerprint_sha256 CHECK (octet_length(fingerprint) = 32),
    CONSTRAINT keys_response_after_completion CHECK (completed_at IS NOT NULL OR response_status IS NULL)
);

-- The sweeper deletes by age; rows arrive in claimed_at order, so a BRIN index is tiny and enough.
CREATE INDEX keys_claimed_at_brin ON keys USING brin (claimed_at);

-- Claims that never completed: the health check's stuck-claims query reads only these.
CREATE INDEX keys_incomplete ON keys (claimed_at) WHERE completed_at IS NULL;

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
CREATE FUNCTION claim(p_scope text, p_key text, p_fingerprint bytea, p_wait_ms integer,
                      p_now timestamptz)
RETURNS TABLE (state text, fingerprint bytea, claimed_at timestamptz, completed_at timestamptz,
               response_status integer, response_headers jsonb, response_body bytea)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET lock_timeout = 2000
AS $claim$
DECLARE
    v_claimed_at timestamptz := coalesce(p_now, now());
BEGIN
    PERFORM set_config('lock_timeout', greatest(p_wait_ms, 1)::text, true);
    BEGIN
        INSERT INTO keys AS k (scope, key, fingerprint, claimed_at)
        VALUES (p_scope, p_key, p_fingerprint, v_claimed_at)
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
        SELECT 'existing'::text, k.fingerprint, k.claimed_at, k.completed_at,
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
