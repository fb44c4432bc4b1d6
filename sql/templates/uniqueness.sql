-- Templates composed with identifiers by control.uniqueness (psycopg.sql):
-- {table} the qualified table (ONLY the table, when it has child tables by
-- inheritance: an index on it covers its own rows alone), {columns} the rule's columns, {tenant} and
-- {key} the tenant and the other key columns as one jsonb, {scope} the rows
-- the rule covers (its columns not null, its WHERE), {order} the primary key,
-- {key_row} and {stored_row} the key columns after tenant_id as one row, of
-- the table (t) and of the stored key read back into the columns' types (k),
-- {key_columns} those columns with their types, as a column definition list.
-- Keys are passed as jsonb text (%(keys)s, %(key)s): a numeric reads back exactly.

-- find_conflicts --
-- Groups of rows sharing the rule's key. GROUP BY puts nulls together, as
-- NULLS NOT DISTINCT does; {scope} leaves them out otherwise.
SELECT {tenant} AS tenant_id, {key} AS key, {key}::text AS key_text, count(*) AS copies
  FROM {table}
 WHERE {scope}
 GROUP BY {columns}
HAVING count(*) > 1

-- compare_conflicts --
-- For the groups found, how many different contents (every column but the
-- ignored ones) each holds: whole rows are compared for those groups only.
-- A group that lost its copies since (a resolve, a retention run) is left out.
SELECT {tenant} AS tenant_id, {key} AS key, {key}::text AS key_text, count(*) AS copies,
       count(DISTINCT to_jsonb(t) - %(ignored)s::text[]) AS versions
  FROM {table} AS t
 WHERE ({tenant}, {key}) IN (SELECT * FROM unnest(%(tenants)s::uuid[], %(keys)s::text[]::jsonb[]))
   AND {scope}
 GROUP BY {columns}
HAVING count(*) > 1

-- live_conflicts --
-- The groups that would make the index build fail now, with the report's
-- classification when the report still describes them (same number of rows),
-- checked on the table or, partitioned, on one of its partitions.
WITH RECURSIVE family (relid) AS (
    SELECT to_regclass(%(table_name)s)::oid
     UNION
    SELECT i.inhrelid
      FROM pg_inherits AS i
      JOIN family AS f ON i.inhparent = f.relid
      JOIN pg_class AS parent ON parent.oid = f.relid AND parent.relkind = 'p'
), live AS (
    SELECT {tenant} AS tenant_id, {key} AS key, count(*) AS copies
      FROM {table}
     WHERE {scope}
     GROUP BY {columns}
    HAVING count(*) > 1
)
SELECT live.tenant_id, live.key, live.copies, c.classification
  FROM live
  LEFT JOIN LATERAL (
        SELECT c.classification
          FROM payhook.uniqueness_conflicts AS c
         WHERE c.tenant_id = live.tenant_id AND c.rule = %(rule)s AND c.key = live.key
           AND c.copies = live.copies AND c.resolved_at IS NULL
           AND to_regclass(c.table_name) IN (SELECT relid FROM family)
         -- Checked twice (on the table and on its partition): the graver one.
         ORDER BY c.classification = 'distinct' DESC
         LIMIT 1
       ) AS c ON true

-- lock_group_rows --
-- The rows of some groups, locked, in primary-key order, with a digest of
-- their content.
SELECT t.ctid::text AS row_ctid, {tenant} AS tenant_id, {key} AS key, {key}::text AS key_text,
       md5((to_jsonb(t) - %(ignored)s::text[])::text) AS content
  FROM {table} AS t
 WHERE ({tenant}, {key}) IN (SELECT * FROM unnest(%(tenants)s::uuid[], %(keys)s::text[]::jsonb[]))
   AND {scope}
 ORDER BY {order}
   FOR UPDATE OF t

-- quarantine_rows --
-- Move surplus copies, whole, from the table into the quarantine.
WITH moved AS (
    DELETE FROM {table} AS t WHERE t.ctid = ANY(%(ctids)s::tid[]) RETURNING t.*
)
INSERT INTO payhook.uniqueness_quarantine (tenant_id, rule, table_name, key, row_data)
SELECT {tenant}, %(rule)s, %(table_name)s, {key}, to_jsonb(moved) FROM moved

-- count_group_rows --
-- The rows a group of the report still has, its stored key read back into the
-- key columns' own types (those columns only: a NOT NULL domain elsewhere in
-- the table is not read) and compared column by column, however it reads as text.
SELECT count(*) AS copies
  FROM {table} AS t
 WHERE {tenant} = %(tenant_id)s::uuid
   AND {key_row} IS NOT DISTINCT FROM (
        SELECT {stored_row} FROM jsonb_to_record(%(key)s::jsonb) AS k({key_columns}))
   AND {scope}
