-- endpoint_version --
-- Moved by every change to webhook_endpoints (migration 0006's trigger).
SELECT version FROM payhook.endpoint_version

-- list_endpoints --
-- Every endpoint with its tenant, gateway and active secrets, for the ingress
-- cache, and the version they are at, read in one snapshot (one row of NULLs
-- beside the version when there is no endpoint; a NULL version if its row is
-- gone, which makes every refresh a full read). A NULL among the secrets
-- (only SQL by hand can write one) is left out, not handed to a verifier.
SELECT (SELECT version FROM payhook.endpoint_version) AS version,
       e.id, e.tenant_id, e.gateway, array_remove(e.secrets, NULL) AS secrets
  FROM (SELECT 1) AS one
  LEFT JOIN payhook.webhook_endpoints AS e ON true
