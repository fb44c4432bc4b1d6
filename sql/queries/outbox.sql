-- claim_outbox_rows --
-- Claim up to %(batch)s due rows for %(lease)s seconds, each with a fresh claim
-- token, and count the attempt. A claimed row is not due again until its lease
-- ends (next_attempt_at = claimed_until), so the partial index on
-- next_attempt_at finds new rows, retries and abandoned claims alike.
-- The tenant's URL and secret are read at claim time, so a changed URL
-- applies to rows still pending.
WITH due AS (
    SELECT tenant_id, id
      FROM payhook.payment_outbox
     WHERE state = 'pending' AND next_attempt_at <= now()
     ORDER BY next_attempt_at
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
UPDATE payhook.payment_outbox AS o
   SET claim_token = gen_random_uuid(),
       claimed_until = now() + make_interval(secs => %(lease)s),
       next_attempt_at = now() + make_interval(secs => %(lease)s),
       attempts = o.attempts + 1
  FROM due
  LEFT JOIN payhook.tenants AS t ON t.id = due.tenant_id
 WHERE o.tenant_id = due.tenant_id AND o.id = due.id
RETURNING o.tenant_id, o.id, o.order_id, o.event_id, o.action, o.payload, o.attempts,
          o.claim_token, o.claimed_until, t.fulfilment_url, t.signing_secret

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
-- Seconds until the earliest pending row is due (negative when one is due now);
-- null when nothing is pending.
SELECT extract(epoch FROM min(next_attempt_at) - now())::float8 AS seconds
  FROM payhook.payment_outbox
 WHERE state = 'pending'

-- list_outbox_rows --
-- Newest rows first, optionally of one state, for operators.
SELECT id, tenant_id, order_id, event_id, action, state, attempts, created_at,
       next_attempt_at, claimed_until, delivered_at, last_error
  FROM payhook.payment_outbox
 WHERE %(state)s::text IS NULL OR state = %(state)s::text
 ORDER BY created_at DESC, id
 LIMIT %(limit)s

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
-- Make every dead row due now with a fresh attempt count.
UPDATE payhook.payment_outbox
   SET state = 'pending', attempts = 0, next_attempt_at = now(),
       claim_token = NULL, claimed_until = NULL
 WHERE state = 'dead'

-- notify_outbox --
-- Wake the outbox workers now, as the insert trigger does for new rows.
SELECT pg_notify('payhook_outbox', '')
