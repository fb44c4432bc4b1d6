-- claim_outbox_rows --
-- Claim up to %(batch)s due rows, of any tenant, for %(lease)s seconds, each
-- with a fresh claim token, and count the attempt: the owner's narrow
-- function (migration 0011). A claimed row is not due again until its lease
-- ends (next_attempt_at = claimed_until), so the partial index on
-- next_attempt_at finds new rows, retries and abandoned claims alike. The
-- tenant's URL and secret are read at claim time, so a changed URL applies
-- to rows still pending. The writes below fence on the claim token, each
-- under the row's tenant.
-- With when each row was written and its event's gateway (migration 0016),
-- from the claim's own statement (migration 0020: every row claimed is returned).
SELECT tenant_id, id, order_id, event_id, action, payload, attempts, claim_token,
       claimed_until, fulfilment_url, signing_secret, created_at, gateway
  FROM payhook.claim_outbox_v2(%(batch)s, %(lease)s)

-- mark_outbox_delivered --
-- Fenced completion: only the holder of the current claim token records success.
UPDATE payhook.payment_outbox
   SET state = 'delivered', delivered_at = now(), claim_token = NULL, claimed_until = NULL
 WHERE tenant_id = %(tenant_id)s AND id = %(id)s
   AND claim_token = %(claim_token)s AND state = 'pending'

-- schedule_outbox_retry --
-- Fenced completion of a failed attempt: due again after %(delay)s seconds.
UPDATE payhook.payment_outbox
   SET next_attempt_at = now() + make_interval(secs => %(delay)s),
       last_error = %(error)s, claim_token = NULL, claimed_until = NULL
 WHERE tenant_id = %(tenant_id)s AND id = %(id)s
   AND claim_token = %(claim_token)s AND state = 'pending'

-- mark_outbox_dead --
-- Fenced completion of a permanent failure or of the last attempt.
UPDATE payhook.payment_outbox
   SET state = 'dead', last_error = %(error)s, claim_token = NULL, claimed_until = NULL
 WHERE tenant_id = %(tenant_id)s AND id = %(id)s
   AND claim_token = %(claim_token)s AND state = 'pending'

-- release_outbox_claim --
-- Give back a claimed row that was never attempted (shutdown, lease too short
-- to start): due now, and the claim no longer counts as an attempt.
UPDATE payhook.payment_outbox
   SET next_attempt_at = now(), attempts = greatest(attempts - 1, 0),
       claim_token = NULL, claimed_until = NULL
 WHERE tenant_id = %(tenant_id)s AND id = %(id)s
   AND claim_token = %(claim_token)s AND state = 'pending'

-- next_outbox_due --
-- Seconds until the earliest pending row of any tenant is due (negative when
-- one is due now); null when nothing is pending (migration 0011).
SELECT payhook.next_outbox_due_v1() AS seconds

-- list_outbox_rows --
-- Newest rows of every tenant first, optionally of one state, for operators
-- (migration 0011; counted in payhook.cross_tenant_audit).
SELECT id, tenant_id, order_id, event_id, action, state, attempts, created_at,
       next_attempt_at, claimed_until, delivered_at, last_error
  FROM payhook.operator_outbox_v1(%(state)s::text, %(limit)s)

-- get_outbox_row --
-- One row by id, to explain why it cannot be retried.
SELECT id, tenant_id, state, claimed_until > now() AS leased
  FROM payhook.payment_outbox
 WHERE id = %(id)s

-- retry_outbox_row --
-- Make one dead row, or one pending row no worker holds, due now with a fresh
-- attempt count. The last error stays for the record.
UPDATE payhook.payment_outbox
   SET state = 'pending', attempts = 0, next_attempt_at = now(),
       claim_token = NULL, claimed_until = NULL
 WHERE id = %(id)s
   AND (state = 'dead'
        OR (state = 'pending' AND (claimed_until IS NULL OR claimed_until <= now())))
RETURNING id, tenant_id

-- retry_dead_outbox_rows --
-- Make every dead row of every tenant due now with a fresh attempt count
-- (migration 0011; counted in payhook.cross_tenant_audit).
SELECT payhook.operator_retry_dead_outbox_v1() AS retried

-- notify_outbox --
-- Wake the outbox workers now, as the insert trigger does for new rows.
SELECT pg_notify('payhook_outbox', '')
