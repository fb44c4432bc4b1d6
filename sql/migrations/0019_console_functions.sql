-- The operators' console (control.console) reads across tenants through
-- these narrow functions, owned by the schema's owner like those of
-- migration 0011 and counted in payhook.cross_tenant_audit. Each returns
-- one page, newest first, after a keyset cursor (the last row of the page
-- before), on an index of migrations 0001, 0004 and 0018; filters narrow the
-- walk, never turn it into a sort of the whole table. No payload, secret or
-- stored event is returned: identities, states, amounts and times only.

-- Exceptions: 'open', 'resolved' or 'all'; of one kind, tenant or gateway
-- (the receipt's, by its primary key); created within p_newer_than seconds
-- or before p_older_than seconds ago.
CREATE OR REPLACE FUNCTION payhook.operator_exceptions_page_v1(
    p_state text, p_kind text, p_tenant uuid, p_gateway text, p_newer_than float8,
    p_older_than float8, p_before_at timestamptz, p_before_id bigint, p_limit integer)
RETURNS TABLE (
    id bigint, tenant_id uuid, event_id text, order_id uuid, kind text, detail jsonb,
    created_at timestamptz, resolved_at timestamptz, gateway text, event_type text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('console_exceptions');
    RETURN QUERY
    SELECT x.id, x.tenant_id, x.event_id, x.order_id, x.kind, x.detail, x.created_at,
           x.resolved_at, r.gateway, r.event_type
      FROM payhook.payment_exceptions AS x
      LEFT JOIN payhook.payment_event_receipts AS r
        ON r.tenant_id = x.tenant_id AND r.event_id = x.event_id
     WHERE (p_state = 'all'
            OR (p_state = 'open' AND x.resolved_at IS NULL)
            OR (p_state = 'resolved' AND x.resolved_at IS NOT NULL))
       AND (p_kind IS NULL OR x.kind = p_kind)
       AND (p_tenant IS NULL OR x.tenant_id = p_tenant)
       AND (p_gateway IS NULL OR r.gateway = p_gateway)
       AND (p_newer_than IS NULL
            OR x.created_at >= now() - make_interval(secs => p_newer_than))
       AND (p_older_than IS NULL
            OR x.created_at < now() - make_interval(secs => p_older_than))
       AND (p_before_at IS NULL OR (x.created_at, x.id) < (p_before_at, p_before_id))
     ORDER BY x.created_at DESC, x.id DESC
     LIMIT p_limit;
END
$$;

-- Security anomalies, of every tenant and of none, optionally of one kind.
CREATE OR REPLACE FUNCTION payhook.operator_anomalies_page_v1(
    p_kind text, p_before_at timestamptz, p_before_id bigint, p_limit integer)
RETURNS TABLE (
    id bigint, tenant_id uuid, event_id text, endpoint_id uuid, delivery_id uuid, kind text,
    stored_sha256 text, received_sha256 text, detected_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('console_anomalies');
    RETURN QUERY
    SELECT a.id, a.tenant_id, a.event_id, a.endpoint_id, a.delivery_id, a.kind,
           a.stored_sha256, a.received_sha256, a.detected_at
      FROM payhook.security_anomalies AS a
     WHERE (p_kind IS NULL OR a.kind = p_kind)
       AND (p_before_at IS NULL OR (a.detected_at, a.id) < (p_before_at, p_before_id))
     ORDER BY a.detected_at DESC, a.id DESC
     LIMIT p_limit;
END
$$;

-- Outbox rows an operator must see: 'dead' ones, or 'overdue' ones (pending
-- for longer than p_sla seconds, as the outbox_overdue alert counts them).
-- The body sent is not returned.
CREATE OR REPLACE FUNCTION payhook.operator_outbox_page_v1(
    p_view text, p_sla float8, p_before_at timestamptz, p_before_id uuid, p_limit integer)
RETURNS TABLE (
    id uuid, tenant_id uuid, order_id uuid, event_id text, action text, state text,
    attempts integer, created_at timestamptz, next_attempt_at timestamptz,
    claimed_until timestamptz, delivered_at timestamptz, last_error text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('console_outbox');
    RETURN QUERY
    SELECT o.id, o.tenant_id, o.order_id, o.event_id, o.action, o.state, o.attempts,
           o.created_at, o.next_attempt_at, o.claimed_until, o.delivered_at, o.last_error
      FROM payhook.payment_outbox AS o
     WHERE ((p_view = 'dead' AND o.state = 'dead')
            OR (p_view = 'overdue' AND o.state = 'pending'
                AND o.created_at < now() - make_interval(secs => p_sla)))
       AND (p_before_at IS NULL OR (o.created_at, o.id) < (p_before_at, p_before_id))
     ORDER BY o.created_at DESC, o.id DESC
     LIMIT p_limit;
END
$$;

-- Orders whose merchant reference or gateway order id is p_reference, of
-- every tenant.
CREATE OR REPLACE FUNCTION payhook.operator_orders_v1(p_reference text, p_limit integer)
RETURNS TABLE (
    id uuid, tenant_id uuid, merchant_reference text, gateway_order_id text,
    amount_minor bigint, currency text, state text, refunded_minor bigint,
    created_at timestamptz, updated_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('console_orders');
    RETURN QUERY
    SELECT o.id, o.tenant_id, o.merchant_reference, o.gateway_order_id,
           o.amount_minor::bigint, o.currency, o.state, o.refunded_minor::bigint,
           o.created_at, o.updated_at
      FROM payhook.payment_orders AS o
     WHERE o.merchant_reference = p_reference OR o.gateway_order_id = p_reference
     ORDER BY o.created_at DESC, o.id
     LIMIT p_limit;
END
$$;

-- Reconciliation runs of every endpoint (window, found, queued, errors).
CREATE OR REPLACE FUNCTION payhook.operator_reconcile_runs_v1(
    p_before_at timestamptz, p_before_id uuid, p_limit integer)
RETURNS TABLE (
    id uuid, tenant_id uuid, endpoint_id uuid, window_start timestamptz,
    window_end timestamptz, dry_run boolean, listed integer, missing integer,
    queued integer, error text, started_at timestamptz, finished_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('console_reconcile_runs');
    RETURN QUERY
    SELECT r.id, r.tenant_id, r.endpoint_id, r.window_start, r.window_end, r.dry_run,
           r.listed, r.missing, r.queued, r.error, r.started_at, r.finished_at
      FROM payhook.reconcile_runs AS r
     WHERE p_before_at IS NULL OR (r.started_at, r.id) < (p_before_at, p_before_id)
     ORDER BY r.started_at DESC, r.id DESC
     LIMIT p_limit;
END
$$;

REVOKE ALL ON FUNCTION payhook.operator_exceptions_page_v1(
    text, text, uuid, text, float8, float8, timestamptz, bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION payhook.operator_exceptions_page_v1(
    text, text, uuid, text, float8, float8, timestamptz, bigint, integer) TO payhook_app;
REVOKE ALL ON FUNCTION payhook.operator_anomalies_page_v1(text, timestamptz, bigint, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION payhook.operator_anomalies_page_v1(text, timestamptz, bigint, integer)
    TO payhook_app;
REVOKE ALL ON FUNCTION payhook.operator_outbox_page_v1(text, float8, timestamptz, uuid, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION payhook.operator_outbox_page_v1(text, float8, timestamptz, uuid, integer)
    TO payhook_app;
REVOKE ALL ON FUNCTION payhook.operator_orders_v1(text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION payhook.operator_orders_v1(text, integer) TO payhook_app;
REVOKE ALL ON FUNCTION payhook.operator_reconcile_runs_v1(timestamptz, uuid, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION payhook.operator_reconcile_runs_v1(timestamptz, uuid, integer)
    TO payhook_app;
