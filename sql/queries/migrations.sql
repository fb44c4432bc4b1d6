-- create_migrations_table --
-- The record of applied migrations, created before the first one runs.
CREATE SCHEMA IF NOT EXISTS payhook;
CREATE TABLE IF NOT EXISTS payhook.schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- applied_migrations --
-- Versions already applied.
SELECT version FROM payhook.schema_migrations ORDER BY version

-- record_migration --
-- Mark one migration applied, in the migration's own transaction.
INSERT INTO payhook.schema_migrations (version, name) VALUES (%(version)s, %(name)s)

-- try_lock_migrations --
-- Session advisory lock: one migration run at a time. Polled, not waited for:
-- a session blocked in pg_advisory_lock holds a snapshot, which a
-- CREATE INDEX CONCURRENTLY run by the lock holder would wait for forever.
SELECT pg_try_advisory_lock(%(key)s) AS locked

-- unlock_migrations --
-- Release the migration lock.
SELECT pg_advisory_unlock(%(key)s)
