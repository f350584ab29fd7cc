-- Completions that write no index entry: once()'s claims are born completed, and the key store
-- and the inbox keep room on each page for the new version of a row.
--
-- A completion is a HOT update (heap-only tuple: the new version on the same page, no index
-- entry, a smaller WAL record) only when it changes no column that an index reads, predicates
-- included, and when the new version fits on the row's page. keys_incomplete and
-- keys_completed_by_age filter on completed_at, so a claim born with completed_at NULL, as
-- claim()'s are, moves between them when completed: a new primary-key entry, a new
-- keys_completed_by_age entry and the row's new version on another page (PostgreSQL 15, 8
-- connections, a fresh key through once(): 1,145 WAL bytes, 5 index entries; born completed,
-- 886 bytes, 3 entries, pg_walinspect). begin()'s claims have been born completed since its
-- INSERT exists (its transaction stores the response or rolls back); a claim made inside once()
-- is as safe: the block's savepoint ends with the completion, or is rolled back with the claim.
-- claim() gets p_completed for it. A bare claim() keeps completed_at NULL until its completion:
-- its caller may commit it without a response, and the stuck-claims check, which reads
-- keys_incomplete, must see that.
--
-- The completion makes a row longer by its response; with pages filled to the brim by the
-- claims, the new version often does not fit and the update is not HOT (8 connections, bodies
-- of 1 KB: 82 per cent HOT at the default fillfactor of 100, 99.8 at 80). The inbox's
-- done mark cannot be HOT (the row leaves inbox_pending), but a new version on the row's own
-- page is WAL-logged as its difference from the old one: a body is not written again (bodies
-- of 200 bytes, 4,000 events: 1,342 WAL bytes per done mark at fillfactor 100, 906 at 80).
-- Existing pages keep their rows; the room is kept on pages filled from now on.

ALTER TABLE keys SET (fillfactor = 80);
ALTER TABLE inbox SET (fillfactor = 80);

DROP FUNCTION claim(text, text, bytea, integer, timestamptz);

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
SET search_path FROM CURRENT
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
