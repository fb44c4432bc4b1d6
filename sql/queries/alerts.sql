-- count_alert_signals --
-- The alert signals PostgreSQL holds, over every tenant, in one round trip:
-- payload-digest conflicts and jobs the consumer refused (forged or
-- unverifiable signature, unknown endpoint, unreadable job) detected in the
-- last %(window)s seconds, unresolved exceptions of authentic events that
-- named no order, unresolved refusals of events older than the retention
-- horizon, every other unresolved exception, outbox rows still pending
-- %(sla)s seconds after they were written, dead outbox rows, and events
-- reconciliation runs of the window found missing. The owner's narrow
-- function (migrations 0011, 0015), counted in payhook.cross_tenant_audit.
SELECT digest_conflicts, rejected_jobs, unmapped_events, late_events, open_exceptions,
       outbox_overdue, outbox_dead, missed_events
  FROM payhook.alert_signals_v2(%(window)s, %(sla)s)


-- limit_alert_reads --
-- Bound the rest of this transaction: a statement that runs, or waits for a
-- lock, longer than %(timeout_ms)s milliseconds is cancelled, so a table
-- locked by a migration or a VACUUM FULL makes the signals unreadable instead
-- of keeping their reader waiting.
SELECT set_config('statement_timeout', %(timeout_ms)s, true),
       set_config('lock_timeout', %(timeout_ms)s, true)
