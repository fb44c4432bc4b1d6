-- Row-level security: PostgreSQL itself keeps each tenant's rows apart.
--
-- The processes connect as `payhook_app` (PAYHOOK_DATABASE_ROLE), a role
-- without BYPASSRLS, and set the tenant of each transaction:
-- `payhook.tenant_id`, read by `payhook.current_tenant()`. Every table with
-- a tenant_id has row security enabled and forced, with one policy: a row
-- is seen, written and touched only under its own tenant. With no tenant
-- set, no tenant's row is seen.
--
-- What must span tenants goes through the SECURITY DEFINER functions below,
-- each returning only what its caller needs; they run as the owner, the role
-- that runs `payhook migrate`, which must bypass row security (a superuser,
-- or a role with BYPASSRLS). Those of operators (alerts, retention, lists of
-- every tenant, finding an id's tenant) count each call in
-- `payhook.cross_tenant_audit`; those of the processes (the ingress's
-- endpoints, a job's endpoint, outbox claims) run all the time and are not.
--
-- ENABLE and FORCE ROW LEVEL SECURITY take each table's ACCESS EXCLUSIVE
-- lock for a catalog change only, under the runner's lock_timeout.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles
                    WHERE rolname = current_user AND (rolsuper OR rolbypassrls)) THEN
        RAISE EXCEPTION 'payhook migrate must run as the owner of schema payhook, a role that '
            'bypasses row-level security: % is neither a superuser nor BYPASSRLS', current_user
            USING HINT = 'run it as a superuser, or ALTER ROLE ... BYPASSRLS';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'payhook_app') THEN
        BEGIN
            CREATE ROLE payhook_app NOLOGIN NOBYPASSRLS;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- created meanwhile by a migration of another database
        END;
    END IF;
END
$$;

-- The tenant of the current transaction; NULL when none is set.
CREATE OR REPLACE FUNCTION payhook.current_tenant() RETURNS uuid
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT nullif(current_setting('payhook.tenant_id', true), '')::uuid
$$;

-- Set the tenant until the transaction ends, and return it. In a FROM list,
-- a function taking its result (LATERAL) runs after it: one statement sets
-- the tenant and then works under it.
CREATE OR REPLACE FUNCTION payhook.set_tenant(p_tenant_id uuid) RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    SELECT nullif(set_config('payhook.tenant_id', coalesce(p_tenant_id::text, ''), true), '')::uuid
$$;

-- What the processes may do. No DELETE but of a receipt the consumer takes
-- back (0009); retention deletes through its functions below.
GRANT USAGE ON SCHEMA payhook TO payhook_app;
GRANT SELECT, INSERT, UPDATE ON
    payhook.tenants, payhook.webhook_endpoints, payhook.payment_orders,
    payhook.payment_event_receipts, payhook.payment_order_transitions,
    payhook.payment_outbox, payhook.payment_exceptions, payhook.security_anomalies
    TO payhook_app;
GRANT DELETE ON payhook.payment_event_receipts TO payhook_app;
GRANT SELECT ON payhook.payment_event_receipts_archive TO payhook_app;
-- The trigger on webhook_endpoints moves the version as the role that wrote.
GRANT SELECT, INSERT, UPDATE ON payhook.endpoint_version TO payhook_app;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA payhook TO payhook_app;

-- One policy per table with a tenant_id.
DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY[
        'webhook_endpoints', 'payment_orders', 'payment_event_receipts',
        'payment_order_transitions', 'payment_outbox', 'payment_exceptions',
        'payment_event_receipts_archive', 'uniqueness_conflicts', 'uniqueness_quarantine']
    LOOP
        EXECUTE format('ALTER TABLE payhook.%I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE payhook.%I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format('DROP POLICY IF EXISTS tenant_isolation ON payhook.%I', t);
        EXECUTE format(
            'CREATE POLICY tenant_isolation ON payhook.%I '
            'USING (tenant_id = payhook.current_tenant()) '
            'WITH CHECK (tenant_id = payhook.current_tenant())', t);
    END LOOP;
END
$$;

ALTER TABLE payhook.tenants ENABLE ROW LEVEL SECURITY;
ALTER TABLE payhook.tenants FORCE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS tenant_isolation ON payhook.tenants;
CREATE POLICY tenant_isolation ON payhook.tenants
    USING (id = payhook.current_tenant())
    WITH CHECK (id = payhook.current_tenant());

-- An anomaly may precede knowing a tenant (a job naming no endpoint): such a
-- row is written with no tenant set, and read only by operators' functions.
ALTER TABLE payhook.security_anomalies ENABLE ROW LEVEL SECURITY;
ALTER TABLE payhook.security_anomalies FORCE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS tenant_isolation ON payhook.security_anomalies;
CREATE POLICY tenant_isolation ON payhook.security_anomalies
    USING (tenant_id = payhook.current_tenant())
    WITH CHECK (tenant_id IS NOT DISTINCT FROM payhook.current_tenant());

-- Who read or changed what across tenants, counted per day, role and path.
CREATE TABLE IF NOT EXISTS payhook.cross_tenant_audit (
    day date NOT NULL DEFAULT current_date,
    -- The role that logged in, whatever role it took after.
    login text NOT NULL DEFAULT session_user,
    path text NOT NULL,
    calls bigint NOT NULL DEFAULT 1,
    first_at timestamptz NOT NULL DEFAULT now(),
    last_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (day, login, path)
);

CREATE OR REPLACE FUNCTION payhook.audit_cross_tenant(p_path text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO payhook.cross_tenant_audit AS a (path) VALUES (p_path)
    ON CONFLICT (day, login, path) DO UPDATE SET calls = a.calls + 1, last_at = now()
$$;

-- -- The processes' paths ------------------------------------------------------

-- The ingress's cache: every endpoint's tenant, gateway and active secrets
-- (sealed), and the version they are at, in one snapshot (one row of NULLs
-- beside the version when there is no endpoint). A NULL among the secrets
-- (only SQL by hand writes one) is left out.
CREATE OR REPLACE FUNCTION payhook.ingress_endpoints_v1()
RETURNS TABLE (version bigint, id uuid, tenant_id uuid, gateway text, secrets text[])
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT (SELECT v.version FROM payhook.endpoint_version AS v),
           e.id, e.tenant_id, e.gateway, array_remove(e.secrets, NULL)
      FROM (SELECT 1) AS one
      LEFT JOIN payhook.webhook_endpoints AS e ON true
$$;

-- The endpoint a job names, by its id (the URL's), with its tenant, gateway,
-- active and retired secrets (sealed).
CREATE OR REPLACE FUNCTION payhook.endpoint_v1(p_endpoint_id uuid)
RETURNS TABLE (tenant_id uuid, id uuid, gateway text, secrets text[], retired_secrets jsonb)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT e.tenant_id, e.id, e.gateway, array_remove(e.secrets, NULL), e.retired_secrets
      FROM payhook.webhook_endpoints AS e
     WHERE e.id = p_endpoint_id
$$;

-- Whether any stored secret is sealed: a process without a key refuses to
-- start when one is.
CREATE OR REPLACE FUNCTION payhook.any_sealed_secret_v1() RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM payhook.tenants AS t WHERE starts_with(t.signing_secret, 'sealed:'))
        OR EXISTS (SELECT 1 FROM payhook.webhook_endpoints AS e
                    WHERE EXISTS (SELECT 1 FROM unnest(e.secrets) AS s
                                   WHERE starts_with(s, 'sealed:'))
                       OR EXISTS (SELECT 1 FROM jsonb_array_elements(e.retired_secrets) AS r
                                   WHERE starts_with(r ->> 'secret', 'sealed:')))
$$;

-- Claim up to p_batch due outbox rows for p_lease seconds, each with a fresh
-- claim token, and count the attempt (sql/queries/outbox.sql says why so).
-- The tenant's URL and signing secret (sealed) are read at claim time.
CREATE OR REPLACE FUNCTION payhook.claim_outbox_v1(p_batch integer, p_lease float8)
RETURNS TABLE (
    tenant_id uuid, id uuid, order_id uuid, event_id text, action text, payload jsonb,
    attempts integer, claim_token uuid, claimed_until timestamptz, fulfilment_url text,
    signing_secret text)
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
              o.claim_token, o.claimed_until, t.fulfilment_url, t.signing_secret
$$;

-- Seconds until the earliest pending outbox row is due (negative when one is
-- due now); NULL when nothing is pending.
CREATE OR REPLACE FUNCTION payhook.next_outbox_due_v1() RETURNS float8
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT extract(epoch FROM min(o.next_attempt_at) - now())::float8
      FROM payhook.payment_outbox AS o
     WHERE o.state = 'pending'
$$;

-- -- Operators' paths (audited) -----------------------------------------------

-- The alert signals, counted over every tenant (sql/queries/alerts.sql).
CREATE OR REPLACE FUNCTION payhook.alert_signals_v1(p_window float8, p_sla float8)
RETURNS TABLE (
    digest_conflicts bigint, rejected_jobs bigint, unmapped_events bigint,
    late_events bigint, open_exceptions bigint, outbox_overdue bigint, outbox_dead bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('alert_signals');
    RETURN QUERY SELECT
        (SELECT count(*) FROM payhook.security_anomalies AS a
          WHERE a.kind = 'digest_conflict'
            AND a.detected_at > now() - make_interval(secs => p_window)),
        (SELECT count(*) FROM payhook.security_anomalies AS a
          WHERE a.kind <> 'digest_conflict'
            AND a.detected_at > now() - make_interval(secs => p_window)),
        (SELECT count(*) FROM payhook.payment_exceptions AS x
          WHERE x.kind = 'unmapped_order' AND x.resolved_at IS NULL),
        (SELECT count(*) FROM payhook.payment_exceptions AS x
          WHERE x.kind = 'beyond_horizon' AND x.resolved_at IS NULL),
        (SELECT count(*) FROM payhook.payment_exceptions AS x
          WHERE x.kind NOT IN ('unmapped_order', 'beyond_horizon') AND x.resolved_at IS NULL),
        (SELECT count(*) FROM payhook.payment_outbox AS o
          WHERE o.state = 'pending' AND o.created_at < now() - make_interval(secs => p_sla)),
        (SELECT count(*) FROM payhook.payment_outbox AS o WHERE o.state = 'dead');
END
$$;

-- Retention, one batch at a time (sql/queries/retention.sql says how).
CREATE OR REPLACE FUNCTION payhook.retention_archive_receipts_v1(
    p_cutoff timestamptz, p_batch integer, OUT moved bigint, OUT archived bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('retention');
    WITH batch AS (
        SELECT r.tenant_id, r.event_id
          FROM payhook.payment_event_receipts AS r
         WHERE r.received_at < p_cutoff
           AND NOT EXISTS (
               SELECT 1
                 FROM payhook.payment_exceptions AS e
                WHERE e.tenant_id = r.tenant_id AND e.event_id = r.event_id
                  AND e.resolved_at IS NULL
           )
         ORDER BY r.received_at
         LIMIT p_batch
           FOR UPDATE OF r SKIP LOCKED
    ), gone AS (
        DELETE FROM payhook.payment_event_receipts AS r
         USING batch
         WHERE r.tenant_id = batch.tenant_id AND r.event_id = batch.event_id
        RETURNING r.tenant_id, r.event_id, r.payload_sha256, r.outcome, r.occurred_at,
                  r.received_at, r.processed_at
    ), kept AS (
        INSERT INTO payhook.payment_event_receipts_archive
               (tenant_id, event_id, payload_sha256, outcome, occurred_at, received_at,
                processed_at)
        SELECT g.tenant_id, g.event_id, decode(g.payload_sha256, 'hex'), g.outcome,
               g.occurred_at, g.received_at, g.processed_at
          FROM gone AS g
            ON CONFLICT (tenant_id, event_id) DO NOTHING
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM kept) INTO moved, archived;
END
$$;

CREATE OR REPLACE FUNCTION payhook.retention_delete_outbox_v1(
    p_cutoff timestamptz, p_batch integer) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    deleted bigint;
BEGIN
    PERFORM payhook.audit_cross_tenant('retention');
    WITH batch AS (
        SELECT b.tenant_id, b.id
          FROM payhook.payment_outbox AS b
         WHERE b.state = 'delivered' AND b.delivered_at < p_cutoff
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED
    )
    DELETE FROM payhook.payment_outbox AS o
     USING batch
     WHERE o.tenant_id = batch.tenant_id AND o.id = batch.id;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

CREATE OR REPLACE FUNCTION payhook.retention_delete_exceptions_v1(
    p_cutoff timestamptz, p_batch integer) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    deleted bigint;
BEGIN
    PERFORM payhook.audit_cross_tenant('retention');
    WITH batch AS (
        SELECT b.tenant_id, b.id
          FROM payhook.payment_exceptions AS b
         WHERE b.resolved_at < p_cutoff
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED
    )
    DELETE FROM payhook.payment_exceptions AS x
     USING batch
     WHERE x.tenant_id = batch.tenant_id AND x.id = batch.id;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

CREATE OR REPLACE FUNCTION payhook.retention_delete_anomalies_v1(
    p_cutoff timestamptz, p_batch integer) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    deleted bigint;
BEGIN
    PERFORM payhook.audit_cross_tenant('retention');
    WITH batch AS (
        SELECT b.id
          FROM payhook.security_anomalies AS b
         WHERE b.detected_at < p_cutoff
         ORDER BY b.detected_at
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED
    )
    DELETE FROM payhook.security_anomalies AS a
     USING batch
     WHERE a.id = batch.id;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

-- What a retention run with these cutoffs would move or delete (the dry run).
CREATE OR REPLACE FUNCTION payhook.retention_count_expired_v1(
    p_receipts timestamptz, p_outbox timestamptz, p_exceptions timestamptz,
    p_anomalies timestamptz,
    OUT receipts bigint, OUT outbox bigint, OUT exceptions bigint, OUT anomalies bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('retention');
    SELECT
        (SELECT count(*)
           FROM payhook.payment_event_receipts AS r
          WHERE r.received_at < p_receipts
            AND NOT EXISTS (
                SELECT 1
                  FROM payhook.payment_exceptions AS e
                 WHERE e.tenant_id = r.tenant_id AND e.event_id = r.event_id
                   AND e.resolved_at IS NULL)),
        (SELECT count(*) FROM payhook.payment_outbox AS o
          WHERE o.state = 'delivered' AND o.delivered_at < p_outbox),
        (SELECT count(*) FROM payhook.payment_exceptions AS x WHERE x.resolved_at < p_exceptions),
        (SELECT count(*) FROM payhook.security_anomalies AS a WHERE a.detected_at < p_anomalies)
      INTO receipts, outbox, exceptions, anomalies;
END
$$;

-- Operators' lists over every tenant, newest first.
CREATE OR REPLACE FUNCTION payhook.operator_exceptions_v1(
    p_include_resolved boolean, p_kind text, p_limit integer)
RETURNS TABLE (
    id bigint, tenant_id uuid, event_id text, order_id uuid, kind text, detail jsonb,
    created_at timestamptz, resolved_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('list_exceptions');
    RETURN QUERY
    SELECT x.id, x.tenant_id, x.event_id, x.order_id, x.kind, x.detail, x.created_at,
           x.resolved_at
      FROM payhook.payment_exceptions AS x
     WHERE (p_include_resolved OR x.resolved_at IS NULL)
       AND (p_kind IS NULL OR x.kind = p_kind)
     ORDER BY x.created_at DESC, x.id DESC
     LIMIT p_limit;
END
$$;

CREATE OR REPLACE FUNCTION payhook.operator_anomalies_v1(
    p_kind text, p_since float8, p_limit integer)
RETURNS TABLE (
    id bigint, tenant_id uuid, event_id text, endpoint_id uuid, delivery_id uuid, kind text,
    stored_sha256 text, received_sha256 text, detected_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('list_anomalies');
    RETURN QUERY
    SELECT a.id, a.tenant_id, a.event_id, a.endpoint_id, a.delivery_id, a.kind,
           a.stored_sha256, a.received_sha256, a.detected_at
      FROM payhook.security_anomalies AS a
     WHERE (p_kind IS NULL OR a.kind = p_kind)
       AND (p_since IS NULL OR a.detected_at > now() - make_interval(secs => p_since))
     ORDER BY a.detected_at DESC, a.id DESC
     LIMIT p_limit;
END
$$;

CREATE OR REPLACE FUNCTION payhook.operator_outbox_v1(p_state text, p_limit integer)
RETURNS TABLE (
    id uuid, tenant_id uuid, order_id uuid, event_id text, action text, state text,
    attempts integer, created_at timestamptz, next_attempt_at timestamptz,
    claimed_until timestamptz, delivered_at timestamptz, last_error text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM payhook.audit_cross_tenant('list_outbox');
    RETURN QUERY
    SELECT o.id, o.tenant_id, o.order_id, o.event_id, o.action, o.state, o.attempts,
           o.created_at, o.next_attempt_at, o.claimed_until, o.delivered_at, o.last_error
      FROM payhook.payment_outbox AS o
     WHERE p_state IS NULL OR o.state = p_state
     ORDER BY o.created_at DESC, o.id
     LIMIT p_limit;
END
$$;

-- Make every dead outbox row, of every tenant, due now with a fresh attempt count.
CREATE OR REPLACE FUNCTION payhook.operator_retry_dead_outbox_v1() RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    retried bigint;
BEGIN
    PERFORM payhook.audit_cross_tenant('retry_dead_outbox');
    UPDATE payhook.payment_outbox AS o
       SET state = 'pending', attempts = 0, next_attempt_at = now(),
           claim_token = NULL, claimed_until = NULL
     WHERE o.state = 'dead';
    GET DIAGNOSTICS retried = ROW_COUNT;
    RETURN retried;
END
$$;

-- The tenant a row an operator names by its id belongs to, NULL when there is
-- none; the command then works under that tenant.
CREATE OR REPLACE FUNCTION payhook.tenant_of_v1(p_table text, p_id text) RETURNS uuid
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    found uuid;
BEGIN
    PERFORM payhook.audit_cross_tenant('tenant_of:' || p_table);
    IF p_table = 'payment_exceptions' THEN
        SELECT x.tenant_id INTO found FROM payhook.payment_exceptions AS x
         WHERE x.id = p_id::bigint;
    ELSIF p_table = 'payment_outbox' THEN
        SELECT o.tenant_id INTO found FROM payhook.payment_outbox AS o WHERE o.id = p_id::uuid;
    ELSIF p_table = 'webhook_endpoints' THEN
        SELECT e.tenant_id INTO found FROM payhook.webhook_endpoints AS e WHERE e.id = p_id::uuid;
    ELSE
        RAISE EXCEPTION 'tenant_of_v1: no table %', p_table;
    END IF;
    RETURN found;
END
$$;

-- Only payhook_app (and the owner) may call the definer functions.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_proc AS p
          JOIN pg_namespace AS n ON n.oid = p.pronamespace
         WHERE n.nspname = 'payhook' AND p.prosecdef AND p.proname <> 'audit_cross_tenant'
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO payhook_app', f);
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION payhook.audit_cross_tenant(text) FROM PUBLIC;
