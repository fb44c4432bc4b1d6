-- get_endpoint --
-- The endpoint a job names, with its tenant, gateway, active and retired secrets.
SELECT tenant_id, id, gateway, secrets, retired_secrets
  FROM payhook.webhook_endpoints
 WHERE id = %(endpoint_id)s

-- insert_receipt --
-- Step 1: claim the event identity. No row back means it already existed.
INSERT INTO payhook.payment_event_receipts
       (tenant_id, event_id, event_type, payload_sha256, endpoint_id, gateway,
        delivery_id, occurred_at)
VALUES (%(tenant_id)s, %(event_id)s, %(event_type)s, %(digest)s, %(endpoint_id)s,
        %(gateway)s, %(delivery_id)s, %(occurred_at)s)
ON CONFLICT (tenant_id, event_id) DO NOTHING
RETURNING event_id

-- find_archived_receipt --
-- Step 2: whether retention archived the identity. A statement of its own,
-- after the insert, so it sees a retention batch the insert waited for.
SELECT 1 AS archived
  FROM payhook.payment_event_receipts_archive
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s

-- delete_receipt --
-- Take back the receipt just inserted for an identity found in the archive.
DELETE FROM payhook.payment_event_receipts
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s

-- get_receipt --
-- The receipt that made a delivery a duplicate, live or archived. One
-- snapshot sees it in one of the two: retention moves it in one transaction.
SELECT payload_sha256, outcome, processed_at
  FROM payhook.payment_event_receipts
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s
 UNION ALL
SELECT encode(payload_sha256, 'hex'), outcome, processed_at
  FROM payhook.payment_event_receipts_archive
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s
 LIMIT 1

-- lock_order --
-- Step 3: the order either identifier maps to, locked; two rows mean the
-- identifiers name different orders.
SELECT id, merchant_reference, gateway_order_id, amount_minor, currency, state,
       refunded_minor
  FROM payhook.payment_orders
 WHERE tenant_id = %(tenant_id)s
   AND (merchant_reference = %(merchant_reference)s OR gateway_order_id = %(gateway_order_id)s)
 ORDER BY id
   FOR UPDATE

-- move_order --
-- Step 5: the one forward transition and its audit row, in one statement: the
-- audit row exists only if the order moved. One per event.
WITH moved AS (
    UPDATE payhook.payment_orders
       SET state = %(to_state)s, refunded_minor = %(refunded_minor)s, updated_at = now()
     WHERE tenant_id = %(tenant_id)s AND id = %(order_id)s AND state = %(from_state)s
 RETURNING tenant_id, id
)
INSERT INTO payhook.payment_order_transitions
       (tenant_id, order_id, event_id, from_state, to_state, amount_minor)
SELECT tenant_id, id, %(event_id)s, %(from_state)s, %(to_state)s, %(amount_minor)s
  FROM moved

-- insert_outbox --
-- Step 6: the side effect to perform after commit; one per (event, action).
INSERT INTO payhook.payment_outbox (id, tenant_id, order_id, event_id, action, payload)
VALUES (%(id)s, %(tenant_id)s, %(order_id)s, %(event_id)s, %(action)s, %(payload)s)
ON CONFLICT (tenant_id, event_id, action) DO NOTHING

-- insert_exception --
-- An authentic event that could not be applied, with safe metadata.
INSERT INTO payhook.payment_exceptions (tenant_id, event_id, order_id, kind, detail, event)
VALUES (%(tenant_id)s, %(event_id)s, %(order_id)s, %(kind)s, %(detail)s, %(event)s)
RETURNING id

-- mark_receipt_processed --
-- Step 7: the receipt's outcome, the order it mapped to, and when.
UPDATE payhook.payment_event_receipts
   SET outcome = %(outcome)s, order_id = %(order_id)s, processed_at = now()
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s

-- insert_anomaly --
-- A security anomaly: safe metadata only, never a payload or a secret.
INSERT INTO payhook.security_anomalies
       (tenant_id, event_id, endpoint_id, delivery_id, kind, stored_sha256, received_sha256)
VALUES (%(tenant_id)s, %(event_id)s, %(endpoint_id)s, %(delivery_id)s, %(kind)s,
        %(stored_sha256)s, %(received_sha256)s)
