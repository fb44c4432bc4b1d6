-- table_columns --
-- The columns of a table, and what each is: its type, generated (identity or
-- serial), defaulting to a random uuid, stamped on arrival (a default of
-- now()), its place in the primary key (from 0); and whether the table is
-- partitioned, or has child tables by inheritance.
SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type,
       (SELECT relkind = 'p' FROM pg_class WHERE oid = a.attrelid) AS partitioned,
       EXISTS (SELECT 1 FROM pg_inherits WHERE inhparent = a.attrelid) AS has_children,
       a.attidentity <> ''
           OR coalesce(pg_get_expr(d.adbin, d.adrelid), '') LIKE 'nextval(%%' AS generated,
       coalesce(pg_get_expr(d.adbin, d.adrelid), '')
           ~ '^(\w+\.)?(gen_random_uuid|uuid_generate_v[14]|uuidv[47])\(\)$' AS random_default,
       coalesce(pg_get_expr(d.adbin, d.adrelid), '')
           IN ('now()', 'CURRENT_TIMESTAMP', 'statement_timestamp()', 'clock_timestamp()')
           AS arrival_stamp,
       array_position(pk.indkey::int2[], a.attnum) AS key_position
  FROM pg_attribute a
  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
  LEFT JOIN pg_index pk ON pk.indrelid = a.attrelid AND pk.indisprimary
 WHERE a.attrelid = to_regclass(%(table)s) AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum

-- record_conflict --
-- One group the check found, classified, in the report. (Named by its
-- constraint: before 0007 the key left the table out.)
INSERT INTO payhook.uniqueness_conflicts
       (tenant_id, rule, table_name, key, copies, versions, classification, ignored)
VALUES (%(tenant_id)s, %(rule)s, %(table_name)s, %(key)s::jsonb, %(copies)s, %(versions)s,
        %(classification)s, %(ignored)s)
    ON CONFLICT ON CONSTRAINT uniqueness_conflicts_pkey DO UPDATE
   SET table_name = excluded.table_name, copies = excluded.copies, versions = excluded.versions,
       classification = excluded.classification, ignored = excluded.ignored,
       checked_at = now(), resolved_at = NULL

-- close_vanished_conflicts --
-- After a check: groups of the rule on that table it no longer found are resolved.
UPDATE payhook.uniqueness_conflicts
   SET resolved_at = now()
 WHERE rule = %(rule)s AND table_name = %(table_name)s AND resolved_at IS NULL
   AND checked_at < now()

-- open_redeliveries --
-- A batch of unresolved redelivery groups of a rule on a table, for resolve, after the
-- last group of the previous batch (none: from the first). The key also as
-- text, which reads back exactly.
SELECT tenant_id, key, key::text AS key_text, ignored
  FROM payhook.uniqueness_conflicts
 WHERE rule = %(rule)s AND table_name = %(table_name)s AND classification = 'redelivery'
   AND resolved_at IS NULL
   AND (%(after_tenant)s::uuid IS NULL
        OR (tenant_id, key) > (%(after_tenant)s::uuid, %(after_key)s::jsonb))
 ORDER BY tenant_id, key
 LIMIT %(limit)s

-- settle_conflict --
-- A group resolve collapsed, or found already gone.
UPDATE payhook.uniqueness_conflicts
   SET resolved_at = now()
 WHERE tenant_id = %(tenant_id)s AND rule = %(rule)s AND table_name = %(table_name)s
   AND key = %(key)s::jsonb

-- reclassify_conflict --
-- A redelivery group whose rows no longer agree: legitimate rows after all;
-- with the columns that were left out when they were compared.
UPDATE payhook.uniqueness_conflicts
   SET classification = 'distinct', versions = %(versions)s, copies = %(copies)s,
       ignored = %(ignored)s, checked_at = now()
 WHERE tenant_id = %(tenant_id)s AND rule = %(rule)s AND table_name = %(table_name)s
   AND key = %(key)s::jsonb

-- pin_key_settings --
-- For the rest of the transaction, the settings that decide how a key's values
-- read as jsonb: timestamptz in UTC, ISO dates, postgres intervals, exact floats.
SELECT set_config('TimeZone', 'UTC', true), set_config('DateStyle', 'ISO', true),
       set_config('IntervalStyle', 'postgres', true),
       set_config('extra_float_digits', '3', true)
