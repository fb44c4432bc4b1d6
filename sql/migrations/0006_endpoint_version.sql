-- A counter that every change to webhook_endpoints moves, so that the ingress
-- can tell, with one tiny query per refresh, whether its copy of the endpoints
-- is still current, and reads the whole table only when it is not.
--
-- The trigger is per statement (one bump however many rows), and creating it
-- takes a lock that blocks only writes to webhook_endpoints (admin commands),
-- for the catalog change: safe on a live system.
CREATE TABLE IF NOT EXISTS payhook.endpoint_version (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    version bigint NOT NULL
);
INSERT INTO payhook.endpoint_version (version) VALUES (1) ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION payhook.bump_endpoint_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE payhook.endpoint_version SET version = version + 1;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS webhook_endpoints_changed ON payhook.webhook_endpoints;
CREATE TRIGGER webhook_endpoints_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON payhook.webhook_endpoints
    FOR EACH STATEMENT EXECUTE FUNCTION payhook.bump_endpoint_version();
