-- payhook: no-transaction
-- What an event means, beside how it was rendered.
--
-- A gateway may render one event in several shapes: Stripe sends the same
-- event to endpoints pinned to different API versions, each in its own JSON.
-- The receipt's payload digest differs between them, and a repeat compared
-- by it was recorded as a `digest_conflict` anomaly on every API upgrade.
-- Receipts now also keep the digest of what the event means (type,
-- identifiers, amount, currency, status: `meaning`, per gateway), and
-- `apply_event_v2` compares that; the payload digest stays for investigation,
-- and a receipt written before this migration, which has no meaning, is still
-- compared by it. `apply_event_v1` stays for consumers of the release before.
--
-- Statement by statement, outside a transaction: adding a nullable column
-- without a default changes the catalog only, under the runner's
-- lock_timeout. Each statement is safe to run again.

ALTER TABLE payhook.payment_event_receipts ADD COLUMN IF NOT EXISTS meaning_sha256 text;

ALTER TABLE payhook.payment_event_receipts_archive
    ADD COLUMN IF NOT EXISTS meaning_sha256 bytea;

CREATE OR REPLACE FUNCTION payhook.apply_event_v2(
    p_tenant_id uuid,
    p_endpoint_id uuid,
    p_gateway text,
    p_delivery_id uuid,
    p_event jsonb,
    p_forced_outcome text DEFAULT NULL,
    p_forced_detail jsonb DEFAULT NULL
)
RETURNS TABLE (outcome text, order_id uuid, exception_id bigint, parked boolean)
LANGUAGE plpgsql AS $$
-- Apply one authentic event (`p_event`: Event.to_json()) exactly once; safe
-- to call any number of times. As apply_event_v1, but a repeated identity is
-- a conflict only when what it means differs (`meaning`: type, identifiers,
-- amount, currency, status, per gateway), not how the gateway rendered it; a
-- receipt written before it had a meaning is compared by payload digest. `p_forced_outcome` records the receipt with
-- that outcome and changes nothing else (`ignored`; `malformed` and
-- `beyond_horizon` also record an exception, with `p_forced_detail`).
--
-- Every statement runs on a snapshot of its own (READ COMMITTED): the
-- archive is read after the receipt insert, so an insert that waited for a
-- retention batch to commit sees the identity it archived.
#variable_conflict use_column
DECLARE
    v_event_id text := p_event->>'event_id';
    v_digest text := p_event->>'digest';
    v_meaning text := p_event->>'meaning';
    v_stored text;
    v_stored_meaning text;
    v_by_meaning boolean;
    v_orders jsonb;
    v_order jsonb;
    v_order_id uuid;
    v_decision record;
    v_outcome text;
    v_detail jsonb := coalesce(p_forced_detail, '{}');
BEGIN
    parked := false;
    -- 1 claim the event identity.
    INSERT INTO payhook.payment_event_receipts
           (tenant_id, event_id, event_type, payload_sha256, meaning_sha256, endpoint_id,
            gateway, delivery_id, occurred_at)
    VALUES (p_tenant_id, v_event_id, p_event->>'event_type', v_digest, v_meaning,
            p_endpoint_id, p_gateway, p_delivery_id, (p_event->>'occurred_at')::timestamptz)
    ON CONFLICT (tenant_id, event_id) DO NOTHING;

    -- 2 it existed, live or archived (one snapshot sees it in one of the
    -- two: retention moves a receipt in one transaction).
    IF FOUND THEN
        SELECT encode(a.payload_sha256, 'hex'), encode(a.meaning_sha256, 'hex')
          INTO v_stored, v_stored_meaning
          FROM payhook.payment_event_receipts_archive AS a
         WHERE a.tenant_id = p_tenant_id AND a.event_id = v_event_id;
        IF v_stored IS NOT NULL THEN
            -- Archived, perhaps while the insert waited for that batch: the
            -- event was handled long ago. Take the new receipt back.
            DELETE FROM payhook.payment_event_receipts AS r
             WHERE r.tenant_id = p_tenant_id AND r.event_id = v_event_id;
        END IF;
    ELSE
        SELECT stored.payload, stored.meaning INTO v_stored, v_stored_meaning
          FROM (SELECT encode(a.payload_sha256, 'hex') AS payload,
                       encode(a.meaning_sha256, 'hex') AS meaning, 1 AS rank
                  FROM payhook.payment_event_receipts_archive AS a
                 WHERE a.tenant_id = p_tenant_id AND a.event_id = v_event_id
                 UNION ALL
                SELECT r.payload_sha256, r.meaning_sha256, 2
                  FROM payhook.payment_event_receipts AS r
                 WHERE r.tenant_id = p_tenant_id AND r.event_id = v_event_id) AS stored
         ORDER BY stored.rank
         LIMIT 1;
        IF v_stored IS NULL THEN
            RAISE EXCEPTION 'the receipt of event % conflicted and is neither live nor archived',
                v_event_id;
        END IF;
    END IF;
    IF v_stored IS NOT NULL THEN
        -- A duplicate locks nothing and writes nothing: its transaction
        -- commits without a WAL flush. Other content under the same
        -- identity is a security anomaly.
        outcome := 'duplicate';
        v_by_meaning := v_stored_meaning IS NOT NULL AND v_meaning IS NOT NULL;
        IF (v_by_meaning AND v_stored_meaning <> v_meaning)
           OR (NOT v_by_meaning AND v_stored <> v_digest) THEN
            INSERT INTO payhook.security_anomalies
                   (tenant_id, event_id, endpoint_id, delivery_id, kind, stored_sha256,
                    received_sha256)
            VALUES (p_tenant_id, v_event_id, p_endpoint_id, p_delivery_id, 'digest_conflict',
                    CASE WHEN v_by_meaning THEN v_stored_meaning ELSE v_stored END,
                    CASE WHEN v_by_meaning THEN v_meaning ELSE v_digest END);
            outcome := 'digest_conflict';
        END IF;
        RETURN NEXT;
        RETURN;
    END IF;

    IF p_forced_outcome IS NOT NULL OR p_event->>'kind' IS NULL THEN
        v_outcome := coalesce(p_forced_outcome, 'ignored');
    ELSE
        -- 3 lock the order either identifier maps to, after the receipt:
        -- the lock order is always receipt, then order.
        SELECT coalesce(jsonb_agg(to_jsonb(locked) ORDER BY locked.id), '[]') INTO v_orders
          FROM (SELECT o.*
                  FROM payhook.payment_orders AS o
                 WHERE o.tenant_id = p_tenant_id
                   AND (o.merchant_reference = p_event->>'merchant_reference'
                        OR o.gateway_order_id = p_event->>'gateway_order_id')
                 ORDER BY o.id
                   FOR UPDATE) AS locked;
        IF jsonb_array_length(v_orders) = 1 THEN
            v_order := v_orders->0;
            v_order_id := (v_order->>'id')::uuid;
        END IF;
        -- 4 compare identifiers, amount, currency and state.
        v_decision := payhook.decide_v1(p_event, v_orders);
        v_outcome := v_decision.outcome;
        v_detail := v_decision.detail;
    END IF;

    IF v_outcome = 'applied' THEN
        -- 5 to 7: the transition, its outbox row, the receipt's outcome.
        parked := payhook.write_transition_v1(
            p_tenant_id, p_event, v_order, v_decision.to_state, v_decision.refunded_minor,
            v_decision.action);
        outcome := v_outcome;
        order_id := v_order_id;
        RETURN NEXT;
        RETURN;
    ELSIF v_outcome NOT IN ('ignored', 'already_applied', 'superseded') THEN
        -- Authentic but not applicable: kept with safe metadata.
        INSERT INTO payhook.payment_exceptions (tenant_id, event_id, order_id, kind, detail, event)
        VALUES (p_tenant_id, v_event_id, v_order_id, v_outcome, v_detail,
                (p_event - 'meaning') || jsonb_build_object('endpoint_id', p_endpoint_id))
        RETURNING id INTO exception_id;
    END IF;

    -- 7 the receipt's outcome, the order it mapped to, and when.
    UPDATE payhook.payment_event_receipts AS r
       SET outcome = v_outcome, order_id = v_order_id, processed_at = now()
     WHERE r.tenant_id = p_tenant_id AND r.event_id = v_event_id;
    outcome := v_outcome;
    order_id := v_order_id;
    RETURN NEXT;
END;
$$;

-- Retention keeps the meaning in the archive, where late repeats are compared.
CREATE OR REPLACE FUNCTION payhook.retention_archive_receipts_v1(
    p_cutoff timestamptz, p_batch integer, OUT moved bigint, OUT archived bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('retention');
    WITH batch AS (
        SELECT r.tenant_id, r.event_id
          FROM payhook.payment_event_receipts AS r
         WHERE r.received_at < p_cutoff
           AND NOT EXISTS (
               SELECT 1
                 FROM payhook.payment_exceptions AS e
                WHERE e.tenant_id = r.tenant_id AND e.event_id = r.event_id
                  AND e.resolved_at IS NULL
           )
         ORDER BY r.received_at
         LIMIT p_batch
           FOR UPDATE OF r SKIP LOCKED
    ), gone AS (
        DELETE FROM payhook.payment_event_receipts AS r
         USING batch
         WHERE r.tenant_id = batch.tenant_id AND r.event_id = batch.event_id
        RETURNING r.tenant_id, r.event_id, r.payload_sha256, r.meaning_sha256, r.outcome,
                  r.occurred_at, r.received_at, r.processed_at
    ), kept AS (
        INSERT INTO payhook.payment_event_receipts_archive
               (tenant_id, event_id, payload_sha256, meaning_sha256, outcome, occurred_at,
                received_at, processed_at)
        SELECT g.tenant_id, g.event_id, decode(g.payload_sha256, 'hex'),
               decode(g.meaning_sha256, 'hex'), g.outcome, g.occurred_at, g.received_at,
               g.processed_at
          FROM gone AS g
            ON CONFLICT (tenant_id, event_id) DO NOTHING
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM kept) INTO moved, archived;
END
$$;
