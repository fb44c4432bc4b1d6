-- endpoint_version --
-- Moved by every change to webhook_endpoints (migration 0006's trigger).
SELECT version FROM payhook.endpoint_version

-- list_endpoints --
-- Every endpoint with its tenant, gateway, active secrets, settings and
-- credentials, for the ingress
-- cache, and the version they are at, read in one snapshot (one row of NULLs
-- beside the version when there is no endpoint; a NULL version if its row is
-- gone, which makes every refresh a full read). Across tenants, so through
-- the owner's narrow function (migrations 0011, 0014).
SELECT version, id, tenant_id, gateway, secrets, settings, credentials
  FROM payhook.ingress_endpoints_v2()
