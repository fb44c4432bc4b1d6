-- count_alert_signals --
-- The alert signals PostgreSQL holds, in one round trip: payload-digest
-- conflicts and jobs the consumer refused (forged or unverifiable signature,
-- unknown endpoint, unreadable job) detected in the last %(window)s seconds,
-- unresolved exceptions of authentic events that named no order, unresolved
-- refusals of events older than the retention horizon, every other
-- unresolved exception, outbox rows still pending %(sla)s seconds after
-- they were written, and dead outbox rows.
SELECT
    (SELECT count(*)
       FROM payhook.security_anomalies
      WHERE kind = 'digest_conflict'
        AND detected_at > now() - make_interval(secs => %(window)s)) AS digest_conflicts,
    (SELECT count(*)
       FROM payhook.security_anomalies
      WHERE kind <> 'digest_conflict'
        AND detected_at > now() - make_interval(secs => %(window)s)) AS rejected_jobs,
    (SELECT count(*)
       FROM payhook.payment_exceptions
      WHERE kind = 'unmapped_order' AND resolved_at IS NULL) AS unmapped_events,
    (SELECT count(*)
       FROM payhook.payment_exceptions
      WHERE kind = 'beyond_horizon' AND resolved_at IS NULL) AS late_events,
    (SELECT count(*)
       FROM payhook.payment_exceptions
      WHERE kind NOT IN ('unmapped_order', 'beyond_horizon')
        AND resolved_at IS NULL) AS open_exceptions,
    (SELECT count(*)
       FROM payhook.payment_outbox
      WHERE state = 'pending'
        AND created_at < now() - make_interval(secs => %(sla)s)) AS outbox_overdue,
    (SELECT count(*)
       FROM payhook.payment_outbox
      WHERE state = 'dead') AS outbox_dead


-- limit_alert_reads --
-- Bound the rest of this transaction: a statement that runs, or waits for a
-- lock, longer than %(timeout_ms)s milliseconds is cancelled, so a table
-- locked by a migration or a VACUUM FULL makes the signals unreadable instead
-- of keeping their reader waiting.
SELECT set_config('statement_timeout', %(timeout_ms)s, true),
       set_config('lock_timeout', %(timeout_ms)s, true)
