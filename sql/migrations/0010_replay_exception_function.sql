-- The replay of a payment exception as a server-side function, beside
-- payhook.apply_event_v1 (0009). Both entry points, a delivery and a
-- replay, are SQL functions that decide with payhook.decide_v1 and write
-- with payhook.write_transition_v1, so the two cannot come to different
-- decisions or write a transition differently.
--
-- Locks are taken exception, then receipt, then order (FOR UPDATE, by id):
-- the consumer's order, receipt then order, behind a lock no delivery
-- takes, so a replay and a delivery never wait on each other in opposite
-- orders. A caller that must not wait long (the replay of waiting events,
-- inside a consumer's job) sets a local lock_timeout in the same
-- transaction before the call.
--
-- Refusals raise with payhook's own SQLSTATEs, which the caller translates:
--   PH001  no such exception (of that tenant)
--   PH002  the event must not or cannot be replayed: older than the
--          retention horizon, unreadable, or its receipt is gone
--
-- Versioned like the functions of 0009; creating it takes no table lock.

CREATE OR REPLACE FUNCTION payhook.replay_exception_v1(
    p_exception_id bigint,
    p_tenant_id uuid,
    p_dry_run boolean
)
RETURNS TABLE (
    tenant_id uuid, event_id text, outcome text, resolved boolean, changed boolean,
    order_id uuid, from_state text, to_state text, action text, detail jsonb,
    parked boolean)
LANGUAGE plpgsql AS $$
-- Re-apply the event an open exception holds, against its order as it is
-- now; safe to call any number of times. `p_tenant_id` NULL finds the
-- exception whatever its tenant (operators). One row back:
--   outcome   the decision now (`applied`, `already_applied`, `superseded`,
--             or the exception kind that still applies); `resolved` when
--             the exception was already closed, which changes nothing
--   resolved  the exception is closed after this call (or would be)
--   changed   this call wrote something (or would have)
--   parked    applied, and events of the order wait as exceptions (arrived
--             too early): the caller replays them once this commits
-- A dry run takes the same locks and decides the same, and writes nothing.
#variable_conflict use_column
DECLARE
    -- Outcomes after which the event is accounted for and its exception closes.
    c_resolving constant text[] := ARRAY['applied', 'already_applied', 'superseded'];
    -- The fields of the event the consumer stored (Event.to_json()); every
    -- one but `cumulative`, which events stored before it existed lack.
    c_required constant text[] := ARRAY[
        'event_id', 'event_type', 'kind', 'occurred_at', 'gateway_order_id',
        'merchant_reference', 'amount_minor', 'currency', 'digest'];
    v_exception record;
    v_event jsonb;
    v_receipt_outcome text;
    v_settled boolean;
    v_orders jsonb;
    v_order jsonb;
    v_decision record;
    v_outcome text;
    v_resolves boolean;
BEGIN
    resolved := false;
    changed := false;
    parked := false;

    -- 0 the exception: two replays of it run one after the other.
    SELECT x.tenant_id, x.event_id, x.kind, x.event, x.resolved_at INTO v_exception
      FROM payhook.payment_exceptions AS x
     WHERE x.id = p_exception_id
       AND (p_tenant_id IS NULL OR x.tenant_id = p_tenant_id)
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no payment exception %', p_exception_id USING ERRCODE = 'PH001';
    END IF;
    tenant_id := v_exception.tenant_id;
    event_id := v_exception.event_id;
    IF v_exception.resolved_at IS NOT NULL THEN
        -- Never replayed again: a second replay changes nothing.
        outcome := 'resolved';
        resolved := true;
        RETURN NEXT;
        RETURN;
    END IF;

    IF v_exception.kind = 'beyond_horizon' THEN
        RAISE EXCEPTION 'exception % is an event older than the retention horizon: '
            'applying it could repeat an effect whose receipt is gone; resolve it by hand',
            p_exception_id USING ERRCODE = 'PH002';
    END IF;
    -- The event as the consumer stored it. A field this function does not
    -- know could change what the event means (as `cumulative` did for
    -- refunds): such an event is refused, not decided without it.
    IF jsonb_typeof(v_exception.event) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'exception % holds an unreadable event: not a JSON object',
            p_exception_id USING ERRCODE = 'PH002';
    END IF;
    v_event := v_exception.event - 'endpoint_id';
    IF NOT v_event ?& c_required
       OR EXISTS (SELECT 1 FROM jsonb_object_keys(v_event) AS k (name)
                   WHERE k.name <> ALL (c_required || 'cumulative'::text)) THEN
        RAISE EXCEPTION 'exception % holds an unreadable event: not the fields of an event',
            p_exception_id USING ERRCODE = 'PH002';
    END IF;
    IF v_event->>'occurred_at' <> '' THEN
        BEGIN
            PERFORM (v_event->>'occurred_at')::timestamptz;
        EXCEPTION WHEN data_exception THEN
            RAISE EXCEPTION 'exception % holds an unreadable event: occurred_at is not a time',
                p_exception_id USING ERRCODE = 'PH002';
        END;
    END IF;
    IF v_event->>'kind' IS NULL THEN
        RAISE EXCEPTION 'exception % holds an event payhook cannot read (%); '
            'it can only be resolved by hand', p_exception_id, v_exception.kind
            USING ERRCODE = 'PH002';
    END IF;

    -- 1 the event's receipt, before the order: the consumer's lock order.
    SELECT r.outcome INTO v_receipt_outcome
      FROM payhook.payment_event_receipts AS r
     WHERE r.tenant_id = v_exception.tenant_id AND r.event_id = v_event->>'event_id'
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'event % has no receipt any more', v_event->>'event_id'
            USING ERRCODE = 'PH002';
    END IF;
    v_settled := coalesce(v_receipt_outcome = ANY (c_resolving), false);

    -- 3 lock the order either identifier maps to, as apply_event_v1 does.
    SELECT coalesce(jsonb_agg(to_jsonb(locked) ORDER BY locked.id), '[]') INTO v_orders
      FROM (SELECT o.*
              FROM payhook.payment_orders AS o
             WHERE o.tenant_id = v_exception.tenant_id
               AND (o.merchant_reference = v_event->>'merchant_reference'
                    OR o.gateway_order_id = v_event->>'gateway_order_id')
             ORDER BY o.id
               FOR UPDATE) AS locked;
    IF jsonb_array_length(v_orders) = 1 THEN
        v_order := v_orders->0;
        order_id := (v_order->>'id')::uuid;
    END IF;

    -- 4 decide again, against the order as it is now. A receipt another
    -- path settled (a redelivery applied, say) needs no decision.
    IF v_settled THEN
        v_outcome := 'already_applied';
        detail := jsonb_build_object('receipt', v_receipt_outcome);
    ELSE
        v_decision := payhook.decide_v1(v_event, v_orders);
        v_outcome := v_decision.outcome;
        to_state := v_decision.to_state;
        action := v_decision.action;
        detail := nullif(v_decision.detail, '{}'::jsonb);
        IF to_state IS NOT NULL THEN
            from_state := v_order->>'state';
        END IF;
    END IF;
    v_resolves := v_outcome = ANY (c_resolving);
    outcome := v_outcome;
    resolved := v_resolves;
    changed := v_resolves;
    IF p_dry_run OR NOT v_resolves THEN
        RETURN NEXT;
        RETURN;
    END IF;

    IF v_outcome = 'applied' THEN
        -- 5 to 7, the receipt's outcome included: it cannot have settled
        -- already, or the decision would be `already_applied`.
        parked := payhook.write_transition_v1(
            v_exception.tenant_id, v_event, v_order, v_decision.to_state,
            v_decision.refunded_minor, v_decision.action);
    ELSIF NOT v_settled THEN
        -- 7 the receipt's new outcome, the order it mapped to, and when.
        UPDATE payhook.payment_event_receipts AS r
           SET outcome = v_outcome, order_id = (v_order->>'id')::uuid, processed_at = now()
         WHERE r.tenant_id = v_exception.tenant_id AND r.event_id = v_event->>'event_id';
    END IF;
    UPDATE payhook.payment_exceptions AS x
       SET resolved_at = now(),
           detail = x.detail || jsonb_build_object('resolution', 'replay:' || v_outcome)
     WHERE x.tenant_id = v_exception.tenant_id AND x.id = p_exception_id
       AND x.resolved_at IS NULL;
    RETURN NEXT;
END;
$$;
