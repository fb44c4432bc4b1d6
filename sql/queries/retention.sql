-- archive_receipts --
-- One retention batch: receipts received before the cutoff (the run's
-- horizon, the same for every batch) leave the live table and enter the
-- archive in one statement, so any snapshot sees each identity in exactly
-- one of the two. SKIP LOCKED leaves a receipt a consumer holds for the
-- next batch. A receipt whose exception is still open stays live, so the
-- exception can be replayed. Every batch here spans tenants: each is the
-- owner's narrow function (migration 0011), counted in
-- payhook.cross_tenant_audit.
SELECT moved, archived FROM payhook.retention_archive_receipts_v1(%(cutoff)s, %(batch)s)

-- delete_delivered_outbox --
-- One batch of outbox rows delivered before the cutoff.
SELECT payhook.retention_delete_outbox_v1(%(cutoff)s, %(batch)s) AS deleted

-- delete_resolved_exceptions --
-- One batch of exceptions resolved before the cutoff; open ones stay.
SELECT payhook.retention_delete_exceptions_v1(%(cutoff)s, %(batch)s) AS deleted

-- delete_old_anomalies --
-- One batch of security anomalies detected before the cutoff.
SELECT payhook.retention_delete_anomalies_v1(%(cutoff)s, %(batch)s) AS deleted

-- count_expired --
-- What a retention run with these cutoffs would move or delete (the dry run).
SELECT receipts, outbox, exceptions, anomalies
  FROM payhook.retention_count_expired_v1(%(receipts)s, %(outbox)s, %(exceptions)s,
                                          %(anomalies)s)

-- database_now --
-- The database's clock, which a run's cutoffs count back from.
SELECT now() AS now
