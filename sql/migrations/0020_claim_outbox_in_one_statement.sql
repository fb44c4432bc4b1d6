-- claim_outbox_v2 (migration 0016), fixed in place: its contract is unchanged,
-- and a release still running gets the fix too.
--
-- v2 joined the rows claim_outbox_v1 returned with payment_outbox again, in
-- its own statement: that join read the table as it was when v2's statement
-- began, while v1's UPDATE, a statement of its own, could claim a row
-- committed a moment later. Such a row was claimed (its attempt counted, its
-- lease begun) but not returned: no worker delivered it until its lease
-- ended, a minute later by default. Under steady load it happened to a few
-- rows in a hundred.
--
-- Now the claim's own UPDATE returns when each row was written and, from its
-- receipt (committed with it, so visible to the same statement), the gateway.
CREATE OR REPLACE FUNCTION payhook.claim_outbox_v2(p_batch integer, p_lease float8)
RETURNS TABLE (
    tenant_id uuid, id uuid, order_id uuid, event_id text, action text, payload jsonb,
    attempts integer, claim_token uuid, claimed_until timestamptz, fulfilment_url text,
    signing_secret text, created_at timestamptz, gateway text)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH due AS (
        SELECT d.tenant_id, d.id
          FROM payhook.payment_outbox AS d
         WHERE d.state = 'pending' AND d.next_attempt_at <= now()
         ORDER BY d.next_attempt_at
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED
    )
    UPDATE payhook.payment_outbox AS o
       SET claim_token = gen_random_uuid(),
           claimed_until = now() + make_interval(secs => p_lease),
           next_attempt_at = now() + make_interval(secs => p_lease),
           attempts = o.attempts + 1
      FROM due
      LEFT JOIN payhook.tenants AS t ON t.id = due.tenant_id
     WHERE o.tenant_id = due.tenant_id AND o.id = due.id
    RETURNING o.tenant_id, o.id, o.order_id, o.event_id, o.action, o.payload, o.attempts,
              o.claim_token, o.claimed_until, t.fulfilment_url, t.signing_secret,
              o.created_at,
              (SELECT r.gateway FROM payhook.payment_event_receipts AS r
                WHERE r.tenant_id = o.tenant_id AND r.event_id = o.event_id)
$$;

