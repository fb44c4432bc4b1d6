-- The consumer's transaction as two server-side functions, so that a job
-- applies its event in one statement and one round trip, its own
-- transaction (the consumer's connections are in autocommit), and the
-- order's row lock is held only while the server runs the steps, never
-- across a round trip to the worker.
--
--   payhook.decide_v1            the rules: what one event does to the orders
--                                its identifiers mapped to (pure)
--   payhook.write_transition_v1  steps 5 to 7 for an event decided `applied`
--   payhook.apply_event_v1       the seven steps of consumer.transaction
--
-- Their names carry the version of their contract (arguments and results):
-- a change that keeps it replaces them in a later migration (CREATE OR
-- REPLACE, atomic, instant on a live database); one that changes it adds
-- `_v2` beside them, so that consumers of both releases run during a deploy.
-- Creating functions takes no lock on any table.

CREATE OR REPLACE FUNCTION payhook.decide_v1(
    event jsonb, orders jsonb,
    OUT outcome text, OUT to_state text, OUT refunded_minor bigint, OUT detail jsonb,
    OUT action text)
LANGUAGE plpgsql IMMUTABLE AS $$
-- `event` is consumer's Event.to_json(); `orders` the rows its merchant
-- reference or gateway order id mapped to, as JSON objects, ordered by id.
-- One row back: the outcome, and for `applied` the order's new state, its
-- refunded total and the side effect to perform; `detail` is the safe
-- metadata an exception records.
DECLARE
    kind text := event->>'kind';
    amount bigint := (event->>'amount_minor')::bigint;
    o jsonb := orders->0;
    o_state text := o->>'state';
    o_amount bigint := (o->>'amount_minor')::bigint;
    o_refunded bigint := (o->>'refunded_minor')::bigint;
    ids jsonb := jsonb_build_object(
        'merchant_reference', event->'merchant_reference',
        'gateway_order_id', event->'gateway_order_id');
    with_order jsonb := jsonb_build_object('order', jsonb_build_object(
        'merchant_reference', o->'merchant_reference',
        'gateway_order_id', o->'gateway_order_id',
        'state', o->'state'));
    -- States from which a payment counts as taken.
    captured text[] := ARRAY['paid', 'partially_refunded', 'refunded', 'disputed'];
    cumulative boolean := coalesce((event->>'cumulative')::boolean, false);
    total bigint;
BEGIN
    detail := '{}';
    IF jsonb_array_length(orders) = 0 THEN
        outcome := 'unmapped_order';
        detail := ids;
    ELSIF jsonb_array_length(orders) > 1 THEN
        outcome := 'identity_mismatch';
        detail := ids || jsonb_build_object('orders', (
            SELECT jsonb_agg(each.value->'id' ORDER BY each.ordinality)
              FROM jsonb_array_elements(orders) WITH ORDINALITY AS each));
    ELSIF event->>'merchant_reference' IS NOT NULL
          AND event->>'merchant_reference' <> o->>'merchant_reference' THEN
        outcome := 'identity_mismatch';
        detail := ids || with_order;
    ELSIF event->>'gateway_order_id' IS DISTINCT FROM o->>'gateway_order_id' THEN
        -- A different gateway payment for an order already paid: money was
        -- taken twice, which operations must refund.
        outcome := CASE WHEN kind = 'succeeded' AND o_state = ANY (captured)
                        THEN 'second_payment' ELSE 'identity_mismatch' END;
        detail := ids || with_order;
    ELSIF event->>'currency' IS DISTINCT FROM o->>'currency' THEN
        outcome := 'currency_mismatch';
        detail := jsonb_build_object(
            'expected', o->'currency', 'received', event->'currency', 'state', o_state);
    ELSIF amount IS NULL THEN
        RAISE EXCEPTION 'event % of kind % has no amount', event->>'event_id', kind;
    ELSIF kind = 'succeeded' THEN
        IF o_state = ANY (captured) THEN
            outcome := 'already_applied';
        ELSIF amount <> o_amount THEN
            outcome := 'amount_mismatch';
        ELSE
            outcome := 'applied';
            to_state := 'paid';
            refunded_minor := o_refunded;
            action := 'fulfil_order';
        END IF;
    ELSIF kind = 'failed' THEN
        IF o_state = 'failed' THEN
            outcome := 'already_applied';
        ELSIF o_state = ANY (captured) THEN
            -- A failed attempt delivered after the payment that succeeded:
            -- gateways do not promise order, and it changes nothing now.
            outcome := 'superseded';
        ELSIF o_state <> 'pending' THEN
            outcome := 'invalid_transition';
        ELSIF amount <> o_amount THEN
            outcome := 'amount_mismatch';
        ELSE
            outcome := 'applied';
            to_state := 'failed';
            refunded_minor := o_refunded;
            action := 'notify_payment_failed';
        END IF;
    ELSIF kind = 'refunded' THEN
        -- Stripe reports the charge's refunded total; others this refund.
        total := CASE WHEN cumulative THEN amount ELSE o_refunded + amount END;
        IF cumulative AND o_refunded <> 0 AND total <= o_refunded THEN
            outcome := 'already_applied';
        ELSIF o_state <> ALL (ARRAY['paid', 'partially_refunded', 'disputed']) THEN
            outcome := 'invalid_transition';
        ELSIF total > o_amount OR total <= o_refunded THEN
            outcome := 'amount_mismatch';
            detail := jsonb_build_object('refunded', o_refunded);
        ELSE
            outcome := 'applied';
            -- A refund made before a dispute and delivered after it: the
            -- money went back all the same. The order stays disputed.
            to_state := CASE
                WHEN o_state = 'disputed' THEN 'disputed'
                WHEN total = o_amount THEN 'refunded'
                ELSE 'partially_refunded'
            END;
            refunded_minor := total;
            action := 'notify_refund';
        END IF;
    ELSIF kind = 'disputed' THEN
        IF o_state = 'disputed' THEN
            outcome := 'already_applied';
        ELSIF o_state <> ALL (ARRAY['paid', 'partially_refunded', 'refunded']) THEN
            outcome := 'invalid_transition';
        ELSIF amount > o_amount OR amount <= 0 THEN
            outcome := 'amount_mismatch';
        ELSE
            outcome := 'applied';
            to_state := 'disputed';
            refunded_minor := o_refunded;
            action := 'notify_dispute';
        END IF;
    ELSE
        RAISE EXCEPTION 'no rule for event kind %', kind;
    END IF;
    detail := CASE outcome
        WHEN 'already_applied' THEN jsonb_build_object('state', o_state)
        WHEN 'superseded' THEN jsonb_build_object('state', o_state)
        WHEN 'invalid_transition' THEN jsonb_build_object('state', o_state, 'towards', kind)
        WHEN 'amount_mismatch' THEN jsonb_build_object(
            'expected', o_amount, 'received', amount, 'state', o_state) || detail
        ELSE detail
    END;
END;
$$;

CREATE OR REPLACE FUNCTION payhook.write_transition_v1(
    p_tenant_id uuid,
    p_event jsonb,
    p_order jsonb,
    p_to_state text,
    p_refunded_minor bigint,
    p_action text
)
RETURNS boolean
LANGUAGE plpgsql AS $$
-- Steps 5 to 7 for an event decided `applied` against `p_order` (its row as
-- the caller locked it FOR UPDATE, as JSON): the one forward transition, its
-- audit row, its outbox row and the receipt's outcome, in one statement.
-- The order is locked, so its state is the one decided on and it moves;
-- were it ever not to, nothing is written and the function raises: the
-- transaction fails rather than record an effect that did not happen.
-- Returns whether events of the order wait as `invalid_transition`
-- exceptions (arrived too early): the lock is held, so any recorded before
-- this move are seen.
DECLARE
    v_event_id text := p_event->>'event_id';
    -- The amount this transition moved: the payment's, or this refund's (a
    -- refund event may carry the order's new refunded total instead).
    v_amount bigint := CASE
        WHEN p_event->>'kind' = 'refunded'
            THEN p_refunded_minor - (p_order->>'refunded_minor')::bigint
        ELSE (p_event->>'amount_minor')::bigint
    END;
    v_parked boolean;
BEGIN
    WITH moved AS (
        UPDATE payhook.payment_orders AS o
           SET state = p_to_state, refunded_minor = p_refunded_minor, updated_at = now()
         WHERE o.tenant_id = p_tenant_id AND o.id = (p_order->>'id')::uuid
           AND o.state = p_order->>'state'
     RETURNING o.tenant_id, o.id, o.merchant_reference, o.currency
    ), transition AS (
        INSERT INTO payhook.payment_order_transitions
               (tenant_id, order_id, event_id, from_state, to_state, amount_minor)
        SELECT m.tenant_id, m.id, v_event_id, p_order->>'state', p_to_state, v_amount
          FROM moved AS m
    ), outbox AS (
        -- The body the outbox worker sends: safe identifiers only.
        INSERT INTO payhook.payment_outbox (id, tenant_id, order_id, event_id, action, payload)
        SELECT gen_random_uuid(), m.tenant_id, m.id, v_event_id, p_action,
               jsonb_build_object(
                   'action', p_action,
                   'tenant_id', m.tenant_id,
                   'order_id', m.id,
                   'merchant_reference', m.merchant_reference,
                   'event_id', v_event_id,
                   'state', p_to_state,
                   'amount_minor', v_amount,
                   'refunded_minor', p_refunded_minor,
                   'currency', m.currency)
          FROM moved AS m
            ON CONFLICT (tenant_id, event_id, action) DO NOTHING
    )
    UPDATE payhook.payment_event_receipts AS r
       SET outcome = 'applied', order_id = m.id, processed_at = now()
      FROM moved AS m
     WHERE r.tenant_id = p_tenant_id AND r.event_id = v_event_id
    RETURNING EXISTS (
            SELECT 1
              FROM payhook.payment_exceptions AS x
             WHERE x.tenant_id = p_tenant_id AND x.order_id = m.id
               AND x.kind = 'invalid_transition' AND x.resolved_at IS NULL
               AND x.event_id <> v_event_id)
      INTO v_parked;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'order % did not move from %: event % is not applied',
            p_order->>'id', p_order->>'state', v_event_id;
    END IF;
    RETURN v_parked;
END;
$$;

CREATE OR REPLACE FUNCTION payhook.apply_event_v1(
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
-- to call any number of times. `p_forced_outcome` records the receipt with
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
    v_stored text;
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
           (tenant_id, event_id, event_type, payload_sha256, endpoint_id, gateway,
            delivery_id, occurred_at)
    VALUES (p_tenant_id, v_event_id, p_event->>'event_type', v_digest, p_endpoint_id,
            p_gateway, p_delivery_id, (p_event->>'occurred_at')::timestamptz)
    ON CONFLICT (tenant_id, event_id) DO NOTHING;

    -- 2 it existed, live or archived (one snapshot sees it in one of the
    -- two: retention moves a receipt in one transaction).
    IF FOUND THEN
        SELECT encode(a.payload_sha256, 'hex') INTO v_stored
          FROM payhook.payment_event_receipts_archive AS a
         WHERE a.tenant_id = p_tenant_id AND a.event_id = v_event_id;
        IF v_stored IS NOT NULL THEN
            -- Archived, perhaps while the insert waited for that batch: the
            -- event was handled long ago. Take the new receipt back.
            DELETE FROM payhook.payment_event_receipts AS r
             WHERE r.tenant_id = p_tenant_id AND r.event_id = v_event_id;
        END IF;
    ELSE
        SELECT coalesce(
                   (SELECT encode(a.payload_sha256, 'hex')
                      FROM payhook.payment_event_receipts_archive AS a
                     WHERE a.tenant_id = p_tenant_id AND a.event_id = v_event_id),
                   (SELECT r.payload_sha256
                      FROM payhook.payment_event_receipts AS r
                     WHERE r.tenant_id = p_tenant_id AND r.event_id = v_event_id))
          INTO v_stored;
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
        IF v_stored <> v_digest THEN
            INSERT INTO payhook.security_anomalies
                   (tenant_id, event_id, endpoint_id, delivery_id, kind, stored_sha256,
                    received_sha256)
            VALUES (p_tenant_id, v_event_id, p_endpoint_id, p_delivery_id, 'digest_conflict',
                    v_stored, v_digest);
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
                p_event || jsonb_build_object('endpoint_id', p_endpoint_id))
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
