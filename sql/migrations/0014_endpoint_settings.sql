-- Per-endpoint settings a gateway needs beyond its secrets: `settings`, what
-- may be shown (an API base URL, a basic-auth user name, pinned public
-- certificates), and `credentials`, what may not (an API access token, a
-- basic-auth password), each value sealed like a secret
-- (`payhook.sealing.endpoint_aad`, with the credential's name). Both are
-- JSON objects of strings; `payhook.gateways.<name>.SETTINGS` documents the
-- names each gateway reads.
--
-- Columns with a constant default rewrite nothing: safe on a live table.
-- The functions are new versions beside the old ones, which a release still
-- running during the upgrade calls.

ALTER TABLE payhook.webhook_endpoints
    ADD COLUMN IF NOT EXISTS settings jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN IF NOT EXISTS credentials jsonb NOT NULL DEFAULT '{}'::jsonb;

-- Every endpoint, for the ingress cache (as ingress_endpoints_v1), with its
-- settings and credentials.
CREATE OR REPLACE FUNCTION payhook.ingress_endpoints_v2()
RETURNS TABLE (version bigint, id uuid, tenant_id uuid, gateway text, secrets text[],
               settings jsonb, credentials jsonb)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT (SELECT v.version FROM payhook.endpoint_version AS v),
           e.id, e.tenant_id, e.gateway, array_remove(e.secrets, NULL), e.settings, e.credentials
      FROM (SELECT 1) AS one
      LEFT JOIN payhook.webhook_endpoints AS e ON true
$$;

-- The endpoint a job names (as endpoint_v1), with its settings and credentials.
CREATE OR REPLACE FUNCTION payhook.endpoint_v2(p_endpoint_id uuid)
RETURNS TABLE (tenant_id uuid, id uuid, gateway text, secrets text[], retired_secrets jsonb,
               settings jsonb, credentials jsonb)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT e.tenant_id, e.id, e.gateway, array_remove(e.secrets, NULL), e.retired_secrets,
           e.settings, e.credentials
      FROM payhook.webhook_endpoints AS e
     WHERE e.id = p_endpoint_id
$$;

-- Whether any stored secret or credential is sealed (as any_sealed_secret_v1).
CREATE OR REPLACE FUNCTION payhook.any_sealed_secret_v2() RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT payhook.any_sealed_secret_v1()
        OR EXISTS (SELECT 1 FROM payhook.webhook_endpoints AS e
                    WHERE EXISTS (SELECT 1 FROM jsonb_each_text(e.credentials) AS c
                                   WHERE starts_with(c.value, 'sealed:')))
$$;

REVOKE ALL ON FUNCTION payhook.ingress_endpoints_v2() FROM PUBLIC;
REVOKE ALL ON FUNCTION payhook.endpoint_v2(uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION payhook.any_sealed_secret_v2() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION payhook.ingress_endpoints_v2() TO payhook_app;
GRANT EXECUTE ON FUNCTION payhook.endpoint_v2(uuid) TO payhook_app;
GRANT EXECUTE ON FUNCTION payhook.any_sealed_secret_v2() TO payhook_app;
