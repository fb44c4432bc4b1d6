-- table_exists --
-- Whether a (schema-qualified) table exists yet.
SELECT to_regclass(%(table)s) IS NOT NULL AS present

-- invalid_index --
-- An index of the table left invalid by an interrupted CREATE INDEX CONCURRENTLY;
-- unique and ready, it still refuses every write that breaks its rule.
SELECT n.nspname AS schema_name, c.relname AS index_name,
       x.indisunique AS is_unique, x.indisready AS ready
  FROM pg_index x
  JOIN pg_class c ON c.oid = x.indexrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE x.indrelid = to_regclass(%(table)s) AND c.relname = %(index)s AND NOT x.indisvalid

-- index_state --
-- Whether an index exists, is valid, and backs a constraint.
SELECT x.indisvalid AS valid, x.indisunique AS is_unique,
       EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = x.indexrelid) AS constrained
  FROM pg_index x
  JOIN pg_class c ON c.oid = x.indexrelid
 WHERE x.indrelid = to_regclass(%(table)s) AND c.relname = %(index)s

-- disable_lock_timeout --
-- No lock timeout for a concurrent index statement: its waits never queue writers.
SET lock_timeout = 0

-- restore_lock_timeout --
-- Back to the session's lock timeout, as it was given when it connected.
RESET lock_timeout

-- set_statement_timeout --
-- A statement timeout of its own, for the session, until it is restored.
SELECT set_config('statement_timeout', %(timeout)s, false)

-- restore_statement_timeout --
-- Back to the session's statement timeout, as it was given when it connected.
RESET statement_timeout
