-- archive_receipts --
-- One retention batch: receipts received before the cutoff (the run's
-- horizon, the same for every batch) leave the live table and enter the
-- archive in one statement, so any snapshot sees each identity in exactly
-- one of the two. SKIP LOCKED leaves a receipt a consumer holds for the
-- next batch. A receipt whose exception is still open stays live, so the
-- exception can be replayed.
WITH batch AS (
    SELECT r.tenant_id, r.event_id
      FROM payhook.payment_event_receipts AS r
     WHERE r.received_at < %(cutoff)s
       AND NOT EXISTS (
           SELECT 1
             FROM payhook.payment_exceptions AS e
            WHERE e.tenant_id = r.tenant_id AND e.event_id = r.event_id
              AND e.resolved_at IS NULL
       )
     ORDER BY r.received_at
     LIMIT %(batch)s
       FOR UPDATE OF r SKIP LOCKED
), moved AS (
    DELETE FROM payhook.payment_event_receipts AS r
     USING batch
     WHERE r.tenant_id = batch.tenant_id AND r.event_id = batch.event_id
    RETURNING r.tenant_id, r.event_id, r.payload_sha256, r.outcome, r.occurred_at,
              r.received_at, r.processed_at
), archived AS (
    INSERT INTO payhook.payment_event_receipts_archive
           (tenant_id, event_id, payload_sha256, outcome, occurred_at, received_at,
            processed_at)
    SELECT tenant_id, event_id, decode(payload_sha256, 'hex'), outcome, occurred_at,
           received_at, processed_at
      FROM moved
        ON CONFLICT (tenant_id, event_id) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM moved) AS moved, (SELECT count(*) FROM archived) AS archived

-- delete_delivered_outbox --
-- One batch of outbox rows delivered before the cutoff.
WITH batch AS (
    SELECT tenant_id, id
      FROM payhook.payment_outbox
     WHERE state = 'delivered'
       AND delivered_at < %(cutoff)s
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM payhook.payment_outbox AS o
 USING batch
 WHERE o.tenant_id = batch.tenant_id AND o.id = batch.id

-- delete_resolved_exceptions --
-- One batch of exceptions resolved before the cutoff; open ones stay.
WITH batch AS (
    SELECT tenant_id, id
      FROM payhook.payment_exceptions
     WHERE resolved_at < %(cutoff)s
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM payhook.payment_exceptions AS x
 USING batch
 WHERE x.tenant_id = batch.tenant_id AND x.id = batch.id

-- delete_old_anomalies --
-- One batch of security anomalies detected before the cutoff.
WITH batch AS (
    SELECT id
      FROM payhook.security_anomalies
     WHERE detected_at < %(cutoff)s
     ORDER BY detected_at
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM payhook.security_anomalies AS a
 USING batch
 WHERE a.id = batch.id

-- count_expired --
-- What a retention run with these cutoffs would move or delete (the dry run).
SELECT
    (SELECT count(*)
       FROM payhook.payment_event_receipts AS r
      WHERE r.received_at < %(receipts)s
        AND NOT EXISTS (
            SELECT 1
              FROM payhook.payment_exceptions AS e
             WHERE e.tenant_id = r.tenant_id AND e.event_id = r.event_id
               AND e.resolved_at IS NULL
        )) AS receipts,
    (SELECT count(*)
       FROM payhook.payment_outbox
      WHERE state = 'delivered'
        AND delivered_at < %(outbox)s) AS outbox,
    (SELECT count(*)
       FROM payhook.payment_exceptions
      WHERE resolved_at < %(exceptions)s) AS exceptions,
    (SELECT count(*)
       FROM payhook.security_anomalies
      WHERE detected_at < %(anomalies)s) AS anomalies

-- database_now --
-- The database's clock, which a run's cutoffs count back from.
SELECT now() AS now
