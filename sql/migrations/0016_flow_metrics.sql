-- Claims of outbox rows (as claim_outbox_v1) with when each row was written
-- (its event's commit) and the gateway its event came from, for the
-- commit-to-delivery histogram (payhook.flow). The receipt is found by its
-- primary key; a receipt retention archived leaves the gateway NULL.

CREATE OR REPLACE FUNCTION payhook.claim_outbox_v2(p_batch integer, p_lease float8)
RETURNS TABLE (
    tenant_id uuid, id uuid, order_id uuid, event_id text, action text, payload jsonb,
    attempts integer, claim_token uuid, claimed_until timestamptz, fulfilment_url text,
    signing_secret text, created_at timestamptz, gateway text)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT c.tenant_id, c.id, c.order_id, c.event_id, c.action, c.payload, c.attempts,
           c.claim_token, c.claimed_until, c.fulfilment_url, c.signing_secret,
           o.created_at, r.gateway
      FROM payhook.claim_outbox_v1(p_batch, p_lease) AS c
      JOIN payhook.payment_outbox AS o ON o.tenant_id = c.tenant_id AND o.id = c.id
      LEFT JOIN payhook.payment_event_receipts AS r
             ON r.tenant_id = c.tenant_id AND r.event_id = c.event_id
$$;

REVOKE ALL ON FUNCTION payhook.claim_outbox_v2(integer, float8) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION payhook.claim_outbox_v2(integer, float8) TO payhook_app;
