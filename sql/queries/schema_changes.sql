-- table_exists --
-- Whether a (schema-qualified) table exists yet.
SELECT to_regclass(%(table)s) IS NOT NULL AS present

-- invalid_index --
-- An index of the table left invalid by an interrupted CREATE INDEX CONCURRENTLY.
SELECT n.nspname AS schema_name, c.relname AS index_name
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
