-- get_endpoint --
-- The endpoint a job names, with its tenant, gateway, active and retired
-- secrets (a NULL among them, which only SQL by hand can write, left out).
SELECT tenant_id, id, gateway, array_remove(secrets, NULL) AS secrets, retired_secrets
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

-- lock_mapped_order --
-- Steps 2 and 3 in one statement, run after the receipt insert so that its
-- snapshot sees what the insert waited for: the digest stored for the
-- identity, live or archived (retention moves a receipt in one transaction,
-- so one snapshot sees it in one of the two), and the order either
-- identifier maps to, locked. The order is locked only when %(lock)s and the
-- live receipt is the one this transaction inserted (its xmin is our
-- transaction id; a transaction that inserted nothing has none): a duplicate,
-- a re-run of the same job included, locks nothing, writes nothing, and
-- commits without a WAL flush. One row without an order when none is locked;
-- two rows when the identifiers name different orders.
SELECT r.live_sha256, r.archived_sha256,
       o.id, o.merchant_reference, o.gateway_order_id, o.amount_minor, o.currency,
       o.state, o.refunded_minor
  FROM (SELECT live.payload_sha256 AS live_sha256,
               live.xmin = pg_current_xact_id_if_assigned()::xid AS inserted_here,
               (SELECT encode(payload_sha256, 'hex')
                  FROM payhook.payment_event_receipts_archive
                 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s) AS archived_sha256
          FROM (SELECT 1) AS one
          LEFT JOIN payhook.payment_event_receipts AS live
            ON live.tenant_id = %(tenant_id)s AND live.event_id = %(event_id)s
       ) AS r
  LEFT JOIN LATERAL (
        SELECT id, merchant_reference, gateway_order_id, amount_minor, currency, state,
               refunded_minor
          FROM payhook.payment_orders
         WHERE %(lock)s::boolean
           AND r.inserted_here
           AND r.archived_sha256 IS NULL
           AND tenant_id = %(tenant_id)s
           AND (merchant_reference = %(merchant_reference)s
                OR gateway_order_id = %(gateway_order_id)s)
         ORDER BY id
           FOR UPDATE
       ) AS o ON true

-- delete_receipt --
-- Take back the receipt just inserted for an identity found in the archive.
DELETE FROM payhook.payment_event_receipts
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s

-- lock_order --
-- The order either identifier maps to, locked; two rows mean the
-- identifiers name different orders.
SELECT id, merchant_reference, gateway_order_id, amount_minor, currency, state,
       refunded_minor
  FROM payhook.payment_orders
 WHERE tenant_id = %(tenant_id)s
   AND (merchant_reference = %(merchant_reference)s OR gateway_order_id = %(gateway_order_id)s)
 ORDER BY id
   FOR UPDATE

-- apply_transition --
-- Steps 5 to 7 in one statement: the one forward transition, its audit row,
-- its outbox row and the receipt's outcome. The caller holds the order
-- FOR UPDATE, so it moves; were it ever not to, the outcome would be NULL,
-- which the receipt's NOT NULL constraint refuses: the transaction fails
-- rather than record an effect that did not happen. Returns whether events
-- of the order wait as `invalid_transition` exceptions (arrived too early):
-- the lock is held, so any recorded before this move are seen.
WITH moved AS (
    UPDATE payhook.payment_orders
       SET state = %(to_state)s, refunded_minor = %(refunded_minor)s, updated_at = now()
     WHERE tenant_id = %(tenant_id)s AND id = %(order_id)s AND state = %(from_state)s
 RETURNING tenant_id, id
), transition AS (
    INSERT INTO payhook.payment_order_transitions
           (tenant_id, order_id, event_id, from_state, to_state, amount_minor)
    SELECT tenant_id, id, %(event_id)s, %(from_state)s, %(to_state)s, %(amount_minor)s
      FROM moved
), outbox AS (
    INSERT INTO payhook.payment_outbox (id, tenant_id, order_id, event_id, action, payload)
    SELECT %(outbox_id)s, tenant_id, id, %(event_id)s, %(action)s, %(payload)s
      FROM moved
        ON CONFLICT (tenant_id, event_id, action) DO NOTHING
)
UPDATE payhook.payment_event_receipts
   SET outcome = CASE WHEN EXISTS (SELECT 1 FROM moved) THEN %(outcome)s END,
       order_id = %(order_id)s, processed_at = now()
 WHERE tenant_id = %(tenant_id)s AND event_id = %(event_id)s
RETURNING EXISTS (
        SELECT 1 FROM payhook.payment_exceptions
         WHERE tenant_id = %(tenant_id)s AND order_id = %(order_id)s
           AND kind = 'invalid_transition' AND resolved_at IS NULL
           AND event_id <> %(event_id)s
       ) AS parked

-- insert_outbox --
-- One outbox row on its own, for seeding the outbox worker's tests and
-- benchmark; the consumer writes its rows in apply_transition.
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

-- parked_exceptions --
-- The events of an order that arrived too early, oldest first.
SELECT id
  FROM payhook.payment_exceptions
 WHERE tenant_id = %(tenant_id)s AND order_id = %(order_id)s
   AND kind = 'invalid_transition' AND resolved_at IS NULL
 ORDER BY id
