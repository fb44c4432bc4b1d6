-- insert_tenant --
-- A new tenant.
INSERT INTO payhook.tenants (id, name, fulfilment_url, signing_secret)
VALUES (%(id)s, %(name)s, %(fulfilment_url)s, %(signing_secret)s)

-- insert_endpoint --
-- A webhook endpoint of a tenant, with its gateway's settings and sealed credentials.
INSERT INTO payhook.webhook_endpoints (tenant_id, id, gateway, secrets, settings, credentials)
VALUES (%(tenant_id)s, %(id)s, %(gateway)s, %(secrets)s, %(settings)s, %(credentials)s)

-- set_endpoint_config --
-- Replace an endpoint's settings and (sealed) credentials.
UPDATE payhook.webhook_endpoints
   SET settings = %(settings)s, credentials = %(credentials)s
 WHERE tenant_id = %(tenant_id)s AND id = %(id)s
RETURNING id

-- add_endpoint_secret --
-- Start a rotation: the new secret first, the old ones still accepted.
UPDATE payhook.webhook_endpoints
   SET secrets = array_prepend(%(secret)s::text, secrets), rotated_at = now()
 WHERE id = %(id)s
RETURNING id

-- retire_endpoint_secrets --
-- End a rotation: keep only the newest secret active; the others are kept,
-- with the time of retirement, for jobs received before it (pruned after
-- %(keep_days)s days, longer than any job waits in the dead-letter queue).
-- A NULL among the secrets (only SQL by hand writes one) is dropped.
UPDATE payhook.webhook_endpoints
   SET secrets = (array_remove(secrets, NULL))[1:1],
       retired_secrets = (
           SELECT coalesce(jsonb_agg(r), '[]'::jsonb)
             FROM (SELECT r FROM jsonb_array_elements(retired_secrets) r
                    WHERE (r ->> 'retired_at')::timestamptz > now() - make_interval(days => %(keep_days)s)
                   UNION ALL
                   SELECT jsonb_build_object('secret', s, 'retired_at', now())
                     FROM unnest((array_remove(secrets, NULL))[2:]) s) kept
       ),
       rotated_at = now()
 WHERE id = %(id)s
RETURNING id

-- insert_order --
-- A local order awaiting payment.
INSERT INTO payhook.payment_orders
       (tenant_id, id, merchant_reference, gateway_order_id, amount_minor, currency)
VALUES (%(tenant_id)s, %(id)s, %(merchant_reference)s, %(gateway_order_id)s,
        %(amount_minor)s, %(currency)s)

-- set_tenant --
-- The tenant of the rest of this transaction: row-level security shows and
-- lets it write only that tenant's rows (migration 0011).
SELECT payhook.set_tenant(%(tenant_id)s::uuid)

-- tenant_of --
-- The tenant of the row of %(table)s an operator names by its id, NULL when
-- there is none; counted in payhook.cross_tenant_audit (migration 0011).
SELECT payhook.tenant_of_v1(%(table)s, %(id)s) AS tenant_id
