-- The operators' audit trail: every operator action (a command, a
-- dashboard button) writes a row: who, when, from where, what, on which
-- object (of which tenant, about which event), the note given, and the
-- result. No one may change or remove a row: the processes' role is granted
-- SELECT and INSERT only, and a trigger refuses UPDATE, DELETE and TRUNCATE
-- to every role, the owner's included. A new table: nothing to lock.

CREATE TABLE IF NOT EXISTS payhook.operator_actions (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    actor text NOT NULL CHECK (actor <> ''),
    source text NOT NULL CHECK (source IN ('cli', 'dashboard')),
    action text NOT NULL CHECK (action <> ''),
    object_kind text NOT NULL,
    object_id text NOT NULL,
    tenant_id uuid REFERENCES payhook.tenants (id),
    event_id text,
    note text,
    result jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX IF NOT EXISTS operator_actions_event
    ON payhook.operator_actions (tenant_id, event_id) WHERE event_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS operator_actions_at ON payhook.operator_actions (at);

CREATE OR REPLACE FUNCTION payhook.operator_actions_append_only() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'payhook.operator_actions is append-only: % refused', TG_OP
        USING ERRCODE = 'PH003';
END
$$;

DROP TRIGGER IF EXISTS operator_actions_append_only ON payhook.operator_actions;
CREATE TRIGGER operator_actions_append_only
    BEFORE UPDATE OR DELETE ON payhook.operator_actions
    FOR EACH ROW EXECUTE FUNCTION payhook.operator_actions_append_only();
DROP TRIGGER IF EXISTS operator_actions_no_truncate ON payhook.operator_actions;
CREATE TRIGGER operator_actions_no_truncate
    BEFORE TRUNCATE ON payhook.operator_actions
    FOR EACH STATEMENT EXECUTE FUNCTION payhook.operator_actions_append_only();

-- A tenant's rows under that tenant; an action on no tenant's object (a
-- dead-letter job) is written with no tenant set, and read by the owner.
ALTER TABLE payhook.operator_actions ENABLE ROW LEVEL SECURITY;
ALTER TABLE payhook.operator_actions FORCE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS tenant_isolation ON payhook.operator_actions;
CREATE POLICY tenant_isolation ON payhook.operator_actions
    USING (tenant_id = payhook.current_tenant())
    WITH CHECK (tenant_id IS NOT DISTINCT FROM payhook.current_tenant());

GRANT SELECT, INSERT ON payhook.operator_actions TO payhook_app;
