-- get_endpoint --
-- The endpoint a job names, with its tenant, gateway, active and retired
-- secrets, settings and credentials; before its tenant is known, so through
-- the owner's narrow function (migrations 0011, 0014).
SELECT tenant_id, id, gateway, secrets, retired_secrets, settings, credentials
  FROM payhook.endpoint_v2(%(endpoint_id)s)

-- apply_event --
-- Steps 1 to 7 of the consumer's transaction, in one statement: on an
-- autocommit connection, its own transaction (sql/migrations/0009, 0012), under
-- the event's tenant (set first: the function takes it from set_tenant).
SELECT e.outcome, e.order_id, e.exception_id, e.parked
  FROM payhook.set_tenant(%(tenant_id)s::uuid) AS t (tenant_id),
       LATERAL payhook.apply_event_v2(t.tenant_id, %(endpoint_id)s, %(gateway)s,
                                      %(delivery_id)s, %(event)s, %(forced_outcome)s,
                                      %(forced_detail)s) AS e

-- replay_exception --
-- The replay of an exception's event in one statement: the locks (exception,
-- receipt, order), the decision and the writes run on the server
-- (sql/migrations/0010), under the exception's tenant, set first.
SELECT r.tenant_id, r.event_id, r.outcome, r.resolved, r.changed, r.order_id, r.from_state,
       r.to_state, r.action, r.detail, r.parked
  FROM payhook.set_tenant(%(tenant_id)s::uuid) AS t (tenant_id),
       LATERAL payhook.replay_exception_v1(%(id)s::bigint, t.tenant_id,
                                           %(dry_run)s::boolean) AS r

-- decide --
-- The rules: what an event (Event.to_json()) does to the orders it mapped
-- to, a JSON array of payment_orders rows, as apply_event_v2 locks them.
SELECT outcome, to_state, refunded_minor, detail, action
  FROM payhook.decide_v1(%(event)s, %(orders)s)

-- insert_outbox --
-- One outbox row on its own, for seeding the outbox worker's tests and
-- benchmark; the consumer writes its rows in write_transition_v1.
INSERT INTO payhook.payment_outbox (id, tenant_id, order_id, event_id, action, payload)
VALUES (%(id)s, %(tenant_id)s, %(order_id)s, %(event_id)s, %(action)s, %(payload)s)
ON CONFLICT (tenant_id, event_id, action) DO NOTHING

-- insert_anomaly --
-- A security anomaly: safe metadata only, never a payload or a secret.
INSERT INTO payhook.security_anomalies
       (tenant_id, event_id, endpoint_id, delivery_id, kind, stored_sha256, received_sha256)
VALUES (%(tenant_id)s, %(event_id)s, %(endpoint_id)s, %(delivery_id)s, %(kind)s,
        %(stored_sha256)s, %(received_sha256)s)

-- parked_exceptions --
-- The events of an order that arrived too early, oldest first.
SELECT id
  FROM payhook.payment_exceptions
 WHERE tenant_id = %(tenant_id)s AND order_id = %(order_id)s
   AND kind = 'invalid_transition' AND resolved_at IS NULL
 ORDER BY id
