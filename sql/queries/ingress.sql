-- list_endpoints --
-- Every endpoint with its tenant, gateway and active secrets, for the ingress cache.
SELECT id, tenant_id, gateway, secrets
  FROM payhook.webhook_endpoints
