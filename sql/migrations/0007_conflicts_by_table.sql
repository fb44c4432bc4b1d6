-- The uniqueness report keyed by table too. `payhook uniqueness resolve`
-- takes a partitioned table one partition at a time, under the rule's one
-- name: keyed by rule and key only, a key found in two partitions was one
-- group, and the check or resolve of one partition settled the groups of
-- another.
--
-- The new primary key is built in this transaction, under ACCESS EXCLUSIVE on
-- the report table alone: only `payhook uniqueness` reads or writes it, and
-- it holds one row per group found. Nothing on the event path waits.
ALTER TABLE payhook.uniqueness_conflicts
    DROP CONSTRAINT uniqueness_conflicts_pkey,
    ADD CONSTRAINT uniqueness_conflicts_pkey PRIMARY KEY (tenant_id, rule, table_name, key);
