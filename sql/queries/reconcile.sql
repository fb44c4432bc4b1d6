-- known_events --
-- Which of %(event_ids)s the tenant has a receipt for, live or archived.
SELECT event_id FROM payhook.payment_event_receipts
 WHERE tenant_id = %(tenant_id)s AND event_id = ANY(%(event_ids)s::text[])
 UNION
SELECT event_id FROM payhook.payment_event_receipts_archive
 WHERE tenant_id = %(tenant_id)s AND event_id = ANY(%(event_ids)s::text[])

-- insert_reconcile_run --
-- A run begun.
INSERT INTO payhook.reconcile_runs
       (tenant_id, id, endpoint_id, window_start, window_end, dry_run, cursor)
VALUES (%(tenant_id)s, %(id)s, %(endpoint_id)s, %(window_start)s, %(window_end)s,
        %(dry_run)s, %(cursor)s)

-- update_reconcile_run --
-- What a run has done so far, and how it ended once it has.
UPDATE payhook.reconcile_runs
   SET listed = %(listed)s, missing = %(missing)s, queued = %(queued)s, cursor = %(cursor)s,
       error = %(error)s, finished_at = CASE WHEN %(finished)s THEN now() END
 WHERE tenant_id = %(tenant_id)s AND id = %(id)s

-- last_reconcile_run --
-- The endpoint's latest run.
SELECT id, window_start, window_end, dry_run, listed, missing, queued, cursor, error,
       started_at, finished_at
  FROM payhook.reconcile_runs
 WHERE tenant_id = %(tenant_id)s AND endpoint_id = %(endpoint_id)s
 ORDER BY started_at DESC
 LIMIT 1

-- list_reconcile_runs --
-- The endpoint's runs, newest first.
SELECT id, window_start, window_end, dry_run, listed, missing, queued, cursor, error,
       started_at, finished_at
  FROM payhook.reconcile_runs
 WHERE tenant_id = %(tenant_id)s AND endpoint_id = %(endpoint_id)s
 ORDER BY started_at DESC
 LIMIT %(limit)s
