-- any_sealed_secret --
-- Whether any stored secret is sealed: a process without a key refuses to
-- start when one is. Across tenants: the owner's narrow function (0011).
SELECT payhook.any_sealed_secret_v2() AS sealed

-- lock_tenants_to_seal --
-- Up to %(batch)s tenants after %(after)s (by id; NULL: from the start) whose
-- signing secret is not sealed under the current key (%(prefix)s), locked for
-- resealing; rows another transaction holds are skipped, not waited for.
SELECT id, signing_secret
  FROM payhook.tenants
 WHERE (%(after)s::uuid IS NULL OR id > %(after)s::uuid)
   AND NOT starts_with(signing_secret, %(prefix)s)
 ORDER BY id
 LIMIT %(batch)s
   FOR UPDATE SKIP LOCKED

-- set_tenant_secret --
-- Store a tenant's resealed signing secret.
UPDATE payhook.tenants SET signing_secret = %(signing_secret)s WHERE id = %(id)s

-- lock_endpoints_to_seal --
-- Up to %(batch)s endpoints after %(after)s (by id; NULL: from the start) with
-- a secret, active or retired, or a credential not sealed under the current key (%(prefix)s),
-- locked for resealing; rows another transaction holds are skipped.
SELECT e.tenant_id, e.id, e.secrets, e.retired_secrets, e.credentials
  FROM payhook.webhook_endpoints AS e
 WHERE (%(after)s::uuid IS NULL OR e.id > %(after)s::uuid)
   AND (EXISTS (SELECT 1 FROM unnest(e.secrets) AS s WHERE NOT starts_with(s, %(prefix)s))
        OR EXISTS (SELECT 1 FROM jsonb_array_elements(e.retired_secrets) AS r
                    WHERE NOT starts_with(r ->> 'secret', %(prefix)s))
        OR EXISTS (SELECT 1 FROM jsonb_each_text(e.credentials) AS c
                    WHERE NOT starts_with(c.value, %(prefix)s)))
 ORDER BY e.id
 LIMIT %(batch)s
   FOR UPDATE SKIP LOCKED

-- set_endpoint_secrets --
-- Store an endpoint's resealed secrets; the rotation time is left as it was.
UPDATE payhook.webhook_endpoints
   SET secrets = %(secrets)s, retired_secrets = %(retired_secrets)s,
       credentials = %(credentials)s
 WHERE tenant_id = %(tenant_id)s AND id = %(id)s

-- count_secrets_to_seal --
-- Tenants and endpoints holding a secret not sealed under the current key.
SELECT (SELECT count(*) FROM payhook.tenants
         WHERE NOT starts_with(signing_secret, %(prefix)s)) AS tenants,
       (SELECT count(*) FROM payhook.webhook_endpoints AS e
         WHERE EXISTS (SELECT 1 FROM unnest(e.secrets) AS s WHERE NOT starts_with(s, %(prefix)s))
            OR EXISTS (SELECT 1 FROM jsonb_array_elements(e.retired_secrets) AS r
                        WHERE NOT starts_with(r ->> 'secret', %(prefix)s))
            OR EXISTS (SELECT 1 FROM jsonb_each_text(e.credentials) AS c
                        WHERE NOT starts_with(c.value, %(prefix)s))) AS endpoints

-- list_tenants_secrets --
-- Up to %(batch)s tenants' signing secrets after %(after)s, for `payhook secrets check`.
SELECT id, signing_secret
  FROM payhook.tenants
 WHERE (%(after)s::uuid IS NULL OR id > %(after)s::uuid)
 ORDER BY id
 LIMIT %(batch)s

-- list_endpoints_secrets --
-- Up to %(batch)s endpoints' secrets after %(after)s, for `payhook secrets check`.
SELECT tenant_id, id, secrets, retired_secrets, credentials
  FROM payhook.webhook_endpoints
 WHERE (%(after)s::uuid IS NULL OR id > %(after)s::uuid)
 ORDER BY id
 LIMIT %(batch)s
