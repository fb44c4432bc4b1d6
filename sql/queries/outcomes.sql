-- list_checks --
-- The CHECK constraints of the named tables of schema payhook, once per
-- column each constrains, as PostgreSQL prints them. Only the catalog is
-- read: any role that may connect may read it.
SELECT t.relname AS table_name, a.attname AS column_name, c.conname AS constraint_name,
       pg_get_constraintdef(c.oid) AS definition
  FROM pg_constraint AS c
  JOIN pg_class AS t ON t.oid = c.conrelid
  JOIN pg_namespace AS n ON n.oid = t.relnamespace
  JOIN pg_attribute AS a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)
 WHERE c.contype = 'c' AND n.nspname = 'payhook' AND t.relname = ANY (%(tables)s)
 ORDER BY t.relname, a.attname, c.conname
