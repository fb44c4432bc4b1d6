-- A counter that every change to webhook_endpoints moves, so that the ingress
-- can tell, with one tiny query per refresh, whether its copy of the endpoints
-- is still current, and reads the whole table only when it is not.
--
-- The trigger is per statement (one bump however many rows), and puts the
-- counter's row back should it ever be deleted. CREATE OR REPLACE TRIGGER
-- (PostgreSQL 14+) takes SHARE ROW EXCLUSIVE on webhook_endpoints, which
-- blocks only writes to it (admin commands), for the catalog change, also
-- when the file runs again; readers (the ingress, the consumers) go on.
-- Values come from a sequence, which never goes back: a row put back after a
-- deletion cannot repeat a version a reader already holds.
CREATE SEQUENCE IF NOT EXISTS payhook.endpoint_version_seq;
CREATE TABLE IF NOT EXISTS payhook.endpoint_version (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    version bigint NOT NULL DEFAULT nextval('payhook.endpoint_version_seq')
);
INSERT INTO payhook.endpoint_version DEFAULT VALUES ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION payhook.bump_endpoint_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO payhook.endpoint_version DEFAULT VALUES
        ON CONFLICT (only_row) DO UPDATE SET version = nextval('payhook.endpoint_version_seq');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER webhook_endpoints_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON payhook.webhook_endpoints
    FOR EACH STATEMENT EXECUTE FUNCTION payhook.bump_endpoint_version();
