-- Every function of pgonce's schema searches that schema, then pg_temp: a caller's temporary
-- table never stands in for one of pgonce's.
--
-- claim(), inbox_store() and outbox_enqueue() were created with `SET search_path FROM CURRENT`
-- while the migration runner's search_path was pgonce's schema alone. PostgreSQL searches the
-- session's temporary schema for tables and types before every schema of search_path unless
-- search_path names pg_temp, so a connection holding a temporary table named keys (or inbox,
-- outbox, outbox_aggregates, ...) had claim() insert the key into that table and read it back
-- from it: the claim was won, then gone with the session, and every other caller won the same key
-- again. PostgreSQL's documentation on SECURITY DEFINER functions gives the remedy: pg_temp named
-- last in the function's search_path, where it is searched after everything else.
--
-- The schema's name is configurable, so it is not written here: the path is set for this
-- transaction from current_schema(), which the runner made pgonce's schema, and each function takes
-- it FROM CURRENT, as schema.sql's functions do. A SET clause replaces the one each function had:
-- a call costs what it did. ALTER FUNCTION updates the function's catalog row and locks no table;
-- a session that cached the function compiles it again on its next call.

SELECT set_config('search_path', current_schema() || ', pg_temp', true);

ALTER FUNCTION claim(text, text, bytea, integer, timestamptz, boolean)
    SET search_path FROM CURRENT;

ALTER FUNCTION outbox_enqueue(text, text, text, jsonb, jsonb, timestamptz, text)
    SET search_path FROM CURRENT;

ALTER FUNCTION inbox_store(text[], text[], bytea[], jsonb[], bytea[], text[], bigint[],
                           timestamptz, text)
    SET search_path FROM CURRENT;
