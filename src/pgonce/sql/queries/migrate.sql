-- The migration runner's statements. {schema} is pgonce's schema.

-- name: lock
-- Serializes concurrent `pgonce migrate` runs on one database; released when the transaction ends,
-- so nothing is held across transactions (safe behind PgBouncer in transaction mode).
SELECT pg_advisory_xact_lock(hashtext('pgonce.migrate'), hashtext(%(schema)s))

-- name: lock_timeout
-- SET LOCAL: bounds each wait of the migration's DDL for a table lock (see DEFAULT_LOCK_TIMEOUT).
SELECT set_config('lock_timeout', %(timeout_ms)s, true)

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: create_ledger
CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: applied
SELECT version FROM {schema}.schema_migrations ORDER BY version

-- name: record
INSERT INTO {schema}.schema_migrations (version, name) VALUES (%(version)s, %(name)s)

-- name: use_schema
-- SET LOCAL: the migration's unqualified names are pgonce's schema's, and pg_temp comes last, so a
-- temporary table of the migrating connection never stands in for one of pgonce's.
SELECT set_config('search_path', %(schema)s || ', pg_temp', true)

-- name: current_version
SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations
