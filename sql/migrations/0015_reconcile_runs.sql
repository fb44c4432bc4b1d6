-- Runs of `payhook reconcile`: which window of an endpoint's gateway events
-- was listed, how many events it named, how many had no receipt and were
-- queued, and how it ended; `cursor` is the last event listed, from which a
-- run that stopped on an error is resumed. A new table: nothing to lock.

CREATE TABLE IF NOT EXISTS payhook.reconcile_runs (
    tenant_id uuid NOT NULL REFERENCES payhook.tenants (id),
    id uuid NOT NULL,
    endpoint_id uuid NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    window_start timestamptz NOT NULL,
    window_end timestamptz NOT NULL,
    dry_run boolean NOT NULL DEFAULT false,
    listed integer NOT NULL DEFAULT 0,
    missing integer NOT NULL DEFAULT 0,
    queued integer NOT NULL DEFAULT 0,
    cursor text,
    error text,
    PRIMARY KEY (tenant_id, id)
);
CREATE INDEX IF NOT EXISTS reconcile_runs_endpoint
    ON payhook.reconcile_runs (endpoint_id, started_at DESC);

ALTER TABLE payhook.reconcile_runs ENABLE ROW LEVEL SECURITY;
ALTER TABLE payhook.reconcile_runs FORCE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS tenant_isolation ON payhook.reconcile_runs;
CREATE POLICY tenant_isolation ON payhook.reconcile_runs
    USING (tenant_id = payhook.current_tenant())
    WITH CHECK (tenant_id = payhook.current_tenant());

GRANT SELECT, INSERT, UPDATE ON payhook.reconcile_runs TO payhook_app;

-- The alert signals (as alert_signals_v1) and `missed_events`: events that
-- reconciliation runs started in the window found with no receipt (queued,
-- or counted by a dry run), over every tenant.
CREATE OR REPLACE FUNCTION payhook.alert_signals_v2(p_window float8, p_sla float8)
RETURNS TABLE (
    digest_conflicts bigint, rejected_jobs bigint, unmapped_events bigint,
    late_events bigint, open_exceptions bigint, outbox_overdue bigint, outbox_dead bigint,
    missed_events bigint)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.digest_conflicts, s.rejected_jobs, s.unmapped_events, s.late_events,
           s.open_exceptions, s.outbox_overdue, s.outbox_dead,
           (SELECT coalesce(sum(r.missing), 0)::bigint FROM payhook.reconcile_runs AS r
             WHERE r.started_at > now() - make_interval(secs => p_window))
      FROM payhook.alert_signals_v1(p_window, p_sla) AS s
$$;

REVOKE ALL ON FUNCTION payhook.alert_signals_v2(float8, float8) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION payhook.alert_signals_v2(float8, float8) TO payhook_app;
