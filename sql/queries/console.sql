-- console_exceptions --
-- One page of exceptions for the console, newest first, after the cursor
-- (migration 0019; counted in payhook.cross_tenant_audit).
SELECT id, tenant_id, event_id, order_id, kind, detail, created_at, resolved_at, gateway,
       event_type
  FROM payhook.operator_exceptions_page_v1(
           %(state)s::text, %(kind)s::text, %(tenant_id)s::uuid, %(gateway)s::text,
           %(newer_than)s::float8, %(older_than)s::float8, %(before_at)s::timestamptz,
           %(before_id)s::bigint, %(limit)s)

-- console_anomalies --
-- One page of security anomalies, newest first, after the cursor.
SELECT id, tenant_id, event_id, endpoint_id, delivery_id, kind, stored_sha256,
       received_sha256, detected_at
  FROM payhook.operator_anomalies_page_v1(
           %(kind)s::text, %(before_at)s::timestamptz, %(before_id)s::bigint, %(limit)s)

-- console_outbox --
-- One page of dead or overdue outbox rows, newest first, after the cursor.
SELECT id, tenant_id, order_id, event_id, action, state, attempts, created_at,
       next_attempt_at, claimed_until, delivered_at, last_error
  FROM payhook.operator_outbox_page_v1(
           %(view)s::text, %(sla)s::float8, %(before_at)s::timestamptz, %(before_id)s::uuid,
           %(limit)s)

-- console_orders --
-- Orders whose merchant reference or gateway order id is the one searched.
SELECT id, tenant_id, merchant_reference, gateway_order_id, amount_minor, currency, state,
       refunded_minor, created_at, updated_at
  FROM payhook.operator_orders_v1(%(reference)s::text, %(limit)s)

-- console_order_events --
-- The events that moved one order, or wait as its open exceptions, newest
-- first (on payment_order_transitions_order and payment_exceptions_open_order).
SELECT event_id, to_state AS what, created_at
  FROM payhook.payment_order_transitions
 WHERE tenant_id = %(tenant_id)s AND order_id = %(order_id)s
 UNION ALL
SELECT event_id, kind, created_at
  FROM payhook.payment_exceptions
 WHERE tenant_id = %(tenant_id)s AND order_id = %(order_id)s AND resolved_at IS NULL
 ORDER BY created_at DESC
 LIMIT %(limit)s

-- console_reconcile_runs --
-- One page of reconciliation runs of every endpoint, newest first.
SELECT id, tenant_id, endpoint_id, window_start, window_end, dry_run, listed, missing,
       queued, error, started_at, finished_at
  FROM payhook.operator_reconcile_runs_v1(
           %(before_at)s::timestamptz, %(before_id)s::uuid, %(limit)s)
