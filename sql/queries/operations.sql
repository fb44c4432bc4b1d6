-- trace_receipt --
-- `payhook trace`: the receipt of one event of one tenant, live or archived
-- by retention (the archive keeps the identity, digest, outcome and times).
SELECT tenant_id, event_id, order_id, event_type, outcome, payload_sha256, endpoint_id,
       gateway, delivery_id, occurred_at, received_at, processed_at,
       NULL::timestamptz AS archived_at
  FROM payhook.payment_event_receipts
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s
 UNION ALL
SELECT tenant_id, event_id, NULL, NULL, outcome, encode(payload_sha256, 'hex'), NULL,
       NULL, NULL, occurred_at, received_at, processed_at, archived_at
  FROM payhook.payment_event_receipts_archive
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s
 LIMIT 1

-- trace_order --
-- `payhook trace`: the order the event mapped to, as it is now.
SELECT id, merchant_reference, gateway_order_id, amount_minor, currency, state,
       refunded_minor, created_at, updated_at
  FROM payhook.payment_orders
 WHERE tenant_id = %(tenant_id)s AND id = %(order_id)s

-- trace_transitions --
-- `payhook trace`: the state transition the event caused (at most one).
SELECT id, order_id, from_state, to_state, amount_minor, created_at
  FROM payhook.payment_order_transitions
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s
 ORDER BY id

-- trace_outbox --
-- `payhook trace`: the side effects the event asked for and their delivery.
SELECT id, action, state, attempts, created_at, next_attempt_at, claimed_until,
       delivered_at, last_error
  FROM payhook.payment_outbox
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s
 ORDER BY created_at, action

-- trace_exceptions --
-- `payhook trace`: why the event could not be applied, if it could not.
SELECT id, kind, order_id, detail, created_at, resolved_at
  FROM payhook.payment_exceptions
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s
 ORDER BY id

-- trace_anomalies --
-- `payhook trace`: security anomalies recorded against the event.
SELECT id, kind, delivery_id, stored_sha256, received_sha256, detected_at
  FROM payhook.security_anomalies
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s
 ORDER BY id

-- list_exceptions --
-- Newest exceptions of one tenant first: open ones, or all; optionally of one kind.
SELECT id, tenant_id, event_id, order_id, kind, detail, created_at, resolved_at
  FROM payhook.payment_exceptions
 WHERE tenant_id = %(tenant_id)s
   AND (%(include_resolved)s::boolean OR resolved_at IS NULL)
   AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
 ORDER BY created_at DESC, id DESC
 LIMIT %(limit)s

-- list_every_tenants_exceptions --
-- The same over every tenant: the owner's narrow function (migration 0011),
-- counted in payhook.cross_tenant_audit.
SELECT id, tenant_id, event_id, order_id, kind, detail, created_at, resolved_at
  FROM payhook.operator_exceptions_v1(%(include_resolved)s::boolean, %(kind)s::text,
                                      %(limit)s)

-- lock_exception --
-- The exception and its stored event, locked, so closing it by hand and a
-- replay of it (which locks it first) run one after the other.
SELECT tenant_id, id, event_id, order_id, kind, event, resolved_at
  FROM payhook.payment_exceptions
 WHERE id = %(id)s
   AND tenant_id = %(tenant_id)s
   FOR UPDATE

-- local_lock_timeout --
-- How long a lock may be waited for, until the transaction ends.
SELECT set_config('lock_timeout', %(timeout)s, true)

-- resolve_exception --
-- Close an exception, recording how it was resolved.
UPDATE payhook.payment_exceptions
   SET resolved_at = now(),
       detail = detail || jsonb_build_object('resolution', %(resolution)s::text)
 WHERE tenant_id = %(tenant_id)s AND id = %(id)s AND resolved_at IS NULL

-- list_anomalies --
-- Newest security anomalies first, of every tenant and of none, optionally
-- of one kind or from the last %(since)s seconds: the owner's narrow
-- function (migration 0011), counted in payhook.cross_tenant_audit.
SELECT id, tenant_id, event_id, endpoint_id, delivery_id, kind, stored_sha256,
       received_sha256, detected_at
  FROM payhook.operator_anomalies_v1(%(kind)s::text, %(since)s::float8, %(limit)s)

-- count_tenants --
-- `payhook up`: whether the database has any tenant yet.
SELECT count(*) AS tenants FROM payhook.tenants

-- find_demo_endpoint --
-- `payhook up`: the demo tenant's endpoint and its newest secret.
SELECT t.id AS tenant_id, e.id AS endpoint_id, e.gateway, e.secrets[1] AS secret
  FROM payhook.tenants AS t
  JOIN payhook.webhook_endpoints AS e ON e.tenant_id = t.id
 WHERE t.name = %(name)s
 ORDER BY t.created_at, e.created_at
 LIMIT 1

-- find_pending_order --
-- `payhook up`: the oldest order of a tenant still awaiting payment.
SELECT id, merchant_reference, gateway_order_id, amount_minor, currency
  FROM payhook.payment_orders
 WHERE tenant_id = %(tenant_id)s AND state = 'pending'
 ORDER BY created_at, id
 LIMIT 1

-- count_orders --
-- `payhook up`: how many orders a tenant has, to name the next demo order.
SELECT count(*) AS orders FROM payhook.payment_orders WHERE tenant_id = %(tenant_id)s
