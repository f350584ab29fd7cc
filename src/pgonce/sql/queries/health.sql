-- Health statements. {schema} is pgonce's schema, composed with psycopg.sql.Identifier.
--
-- Each sweep target has `horizon_<target>`: one row per scope group of its retention policy, over
-- the rows that are deletable once old (the same predicate as its delete_<target> in sweep.sql).
-- Parameters as in sweep.sql (now, default_keep, scopes, keeps). Columns:
--   scope       the scope with its own retention, or NULL for every other scope
--   oldest_age  age of the oldest of those rows at `now` (NULL when there are none)
--   overdue     rows already past their retention
--   deleted_age age at `now` of the newest row the sweeper deleted (sweep_marks.newest), NULL when
--               it deleted none: younger than the retry horizon means a row was deleted while its
--               sender may still retry it; otherwise a young oldest row is only a young table
-- A target whose rows can get stuck also has `stuck_<target>` (count, age of the oldest).
-- Every statement here reads an index range, not the table, so a metrics scrape stays cheap.

-- name: clock
SELECT coalesce(%(now)s::timestamptz, now())

-- name: horizon_keys
-- Both figures come from keys_by_completion, by completed_at as the sweeper ages keys: the oldest
-- key is an index probe, the overdue count reads only overdue rows (none, when the sweeper keeps
-- up).
SELECT g.scope,
       coalesce(%(now)s::timestamptz, now()) - (
           SELECT min(k.completed_at)
             FROM {schema}.keys AS k
            WHERE k.completed_at IS NOT NULL
              AND CASE WHEN g.scope IS NULL THEN k.scope <> ALL (%(scopes)s::text[])
                       ELSE k.scope = g.scope END
       ) AS oldest_age,
       (SELECT count(*)
          FROM {schema}.keys AS k
         WHERE k.completed_at < coalesce(%(now)s::timestamptz, now()) - g.keep
           AND CASE WHEN g.scope IS NULL THEN k.scope <> ALL (%(scopes)s::text[])
                    ELSE k.scope = g.scope END
       ) AS overdue,
       coalesce(%(now)s::timestamptz, now()) - (
           SELECT max(m.newest)
             FROM {schema}.sweep_marks AS m
            WHERE m.target = 'keys'
              AND CASE WHEN g.scope IS NULL THEN m.scope <> ALL (%(scopes)s::text[])
                       ELSE m.scope = g.scope END
       ) AS deleted_age
  FROM (SELECT p.scope, p.keep FROM unnest(%(scopes)s::text[], %(keeps)s::interval[]) AS p(scope, keep)
        UNION ALL
        SELECT NULL, %(default_keep)s::interval) AS g(scope, keep)

-- name: stuck_keys
-- Claims committed without a response and older than the threshold: keys_by_completion finds
-- the claims that never completed (its NULLs), never the retained keys.
SELECT count(*), coalesce(%(now)s::timestamptz, now()) - min(claimed_at)
  FROM {schema}.keys
 WHERE completed_at IS NULL
   AND claimed_at < coalesce(%(now)s::timestamptz, now()) - %(stuck_after)s::interval

-- name: stuck_phases
-- Two-phase requests nobody holds: leases expired longer than the threshold ago
-- (key_leases_expired), by the recovery point they stopped at ('' before the first).
SELECT coalesce(point, ''), count(*)
  FROM {schema}.key_leases
 WHERE locked_until < coalesce(%(now)s::timestamptz, now()) - %(stuck_after)s::interval
 GROUP BY 1
 ORDER BY 2 DESC, 1

-- name: retired_phases
-- Two-phase requests the completer retired whose key is still kept: their lease row stays with
-- locked_until 'infinity' (key_leases_expired) until the sweeper deletes the key. By the recovery
-- point they stopped at ('' before the first), with the age of the newest retirement.
SELECT coalesce(l.point, ''), count(*),
       coalesce(%(now)s::timestamptz, now()) - max(k.completed_at)
  FROM {schema}.key_leases AS l
  JOIN {schema}.keys AS k ON k.scope = l.scope AND k.key = l.key
 WHERE l.locked_until = 'infinity'
 GROUP BY 1
 ORDER BY 2 DESC, 1

-- name: horizon_inbox
-- As horizon_keys, over handled deliveries by source (inbox_finished_by_age).
SELECT g.scope,
       coalesce(%(now)s::timestamptz, now()) - (
           SELECT min(i.received_at)
             FROM {schema}.inbox AS i
            WHERE i.status IN ('done', 'skipped')
              AND CASE WHEN g.scope IS NULL THEN i.source <> ALL (%(scopes)s::text[])
                       ELSE i.source = g.scope END
       ) AS oldest_age,
       (SELECT count(*)
          FROM {schema}.inbox AS i
         WHERE i.status IN ('done', 'skipped')
           AND i.received_at < coalesce(%(now)s::timestamptz, now()) - g.keep
           AND CASE WHEN g.scope IS NULL THEN i.source <> ALL (%(scopes)s::text[])
                    ELSE i.source = g.scope END
       ) AS overdue,
       coalesce(%(now)s::timestamptz, now()) - (
           SELECT max(m.newest)
             FROM {schema}.sweep_marks AS m
            WHERE m.target = 'inbox'
              AND CASE WHEN g.scope IS NULL THEN m.scope <> ALL (%(scopes)s::text[])
                       ELSE m.scope = g.scope END
       ) AS deleted_age
  FROM (SELECT p.scope, p.keep FROM unnest(%(scopes)s::text[], %(keeps)s::interval[]) AS p(scope, keep)
        UNION ALL
        SELECT NULL, %(default_keep)s::interval) AS g(scope, keep)

-- name: horizon_outbox
-- One group (the outbox has no scope), over published rows (outbox_published_at).
SELECT NULL::text AS scope,
       coalesce(%(now)s::timestamptz, now())
         - (SELECT min(published_at) FROM {schema}.outbox WHERE published_at IS NOT NULL)
         AS oldest_age,
       (SELECT count(*) FROM {schema}.outbox
         WHERE published_at IS NOT NULL
           AND published_at < coalesce(%(now)s::timestamptz, now()) - %(default_keep)s::interval)
         AS overdue,
       coalesce(%(now)s::timestamptz, now())
         - (SELECT max(newest) FROM {schema}.sweep_marks WHERE target = 'outbox') AS deleted_age

-- name: horizon_outbox_aggregates
SELECT NULL::text AS scope,
       coalesce(%(now)s::timestamptz, now())
         - (SELECT min(last_enqueued_at) FROM {schema}.outbox_aggregates) AS oldest_age,
       (SELECT count(*) FROM {schema}.outbox_aggregates
         WHERE last_enqueued_at < coalesce(%(now)s::timestamptz, now()) - %(default_keep)s::interval)
         AS overdue,
       coalesce(%(now)s::timestamptz, now())
         - (SELECT max(newest) FROM {schema}.sweep_marks WHERE target = 'outbox_aggregates') AS deleted_age

-- name: sync_standby
-- Whether the server is configured to wait for a synchronous standby, and how many standbys are
-- attached in sync (or quorum) state now. sync_state is readable by superusers and members of
-- pg_read_all_stats (pg_monitor); for other roles it is NULL, counted as unknown. read_only: the
-- server takes no writes (a standby, which a failover may have made of the old primary, or
-- default_transaction_read_only set), so no claim can succeed there.
SELECT current_setting('synchronous_standby_names') <> '' AS configured,
       count(*) FILTER (WHERE r.sync_state IN ('sync', 'quorum')) AS synchronous,
       count(*) FILTER (WHERE r.sync_state IS NULL) AS unknown,
       pg_is_in_recovery() OR current_setting('default_transaction_read_only')::boolean
         AS read_only
  FROM pg_stat_replication AS r

-- name: mvcc_horizon
-- What holds this database's MVCC horizon back: the oldest transaction with an xid or a snapshot
-- (sessions of this database, and prepared transactions), its session's state, and the age in
-- xids of the oldest xmin anything holds (replication slots too). The reader's own transaction
-- is left out. Ages run to clock_timestamp(), not to the reader's now(): a transaction that began
-- after the reader's own is young, never negative. Other roles' sessions are visible to
-- superusers and pg_read_all_stats only.
-- Who holds it: the oldest transaction's pid, application_name and `what` (the first 60
-- characters of its query on one line -- a query can carry values, so never more -- or the gid
-- of a prepared transaction, whose pid and application_name are NULL); and the replication slot
-- with the oldest xmin, with that xmin's age.
WITH open AS (
    SELECT a.xact_start AS since, a.state, a.pid, a.application_name,
           left(regexp_replace(left(a.query, 240), '[[:space:][:cntrl:]]+', ' ', 'g'), 60) AS what
      FROM pg_stat_activity AS a
     WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
       AND (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL)
    UNION ALL
    SELECT p.prepared, 'prepared', NULL, NULL,
           left(regexp_replace(p.gid, '[[:space:][:cntrl:]]+', ' ', 'g'), 60)
      FROM pg_prepared_xacts AS p
     WHERE p.database = current_database()
),
slot AS (
    SELECT s.slot_name, greatest(age(s.xmin), age(s.catalog_xmin)) AS xmin_age
      FROM pg_replication_slots AS s
     WHERE s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL
     ORDER BY 2 DESC, 1
     LIMIT 1
)
SELECT clock_timestamp() - o.since AS oldest,
       o.state,
       coalesce(greatest(
           (SELECT max(greatest(age(a.backend_xid), age(a.backend_xmin)))
              FROM pg_stat_activity AS a
             WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()),
           (SELECT xmin_age FROM slot),
           (SELECT max(age(p.transaction)) FROM pg_prepared_xacts AS p)
       ), 0) AS xmin_age,
       (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
           OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') AS sees_all,
       o.pid,
       o.application_name,
       o.what,
       (SELECT slot_name FROM slot) AS slot,
       coalesce((SELECT xmin_age FROM slot), 0) AS slot_xmin_age
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (
      SELECT since, state, pid, application_name, what FROM open ORDER BY since LIMIT 1
  ) AS o ON true

-- name: server_timeouts
-- The timeouts a new connection of this login role to this database gets, as pgonce's own
-- connections get them: reset_val is a connection's value before any SET (the health check's own
-- SET LOCAL statement_timeout does not change it), in milliseconds, 0 for none. With it, where it
-- is set, from pg_db_role_setting: the most specific entry for this database and role (role in
-- database, then role, then database, PostgreSQL's own order), its role and database names
-- (NULL for all) and the value as written; all NULL when neither sets it (postgresql.conf, or
-- the connection's own options).
SELECT s.name, s.reset_val::bigint AS ms, w.rolname, w.datname, w.value
  FROM pg_settings AS s
  LEFT JOIN LATERAL (
      SELECT r.rolname, d.datname, substr(c.item, length(s.name) + 2) AS value
        FROM pg_db_role_setting AS x
        LEFT JOIN pg_roles AS r ON r.oid = x.setrole
        LEFT JOIN pg_database AS d ON d.oid = x.setdatabase
       CROSS JOIN LATERAL unnest(x.setconfig) AS c(item)
       WHERE x.setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
         AND x.setrole IN (0, (SELECT oid FROM pg_roles WHERE rolname = session_user))
         AND split_part(c.item, '=', 1) = s.name
       ORDER BY (x.setrole <> 0 AND x.setdatabase <> 0) DESC, (x.setrole <> 0) DESC
       LIMIT 1
  ) AS w ON true
 WHERE s.name IN ('statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout')
 ORDER BY s.name

-- name: schema_version
-- The last migration applied (the ledger `pgonce migrate` writes); judged against the last one
-- this code ships, so that a pending migration is a failed check, not a healthy report.
SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations

-- name: setting
-- A setting's value as this connection has it: asked after a statement the setting cut (a
-- statement_timeout or lock_timeout the database or role sets), to name the value in the report.
SELECT current_setting(%(name)s)
