-- payhook: no-transaction
-- The gateways are named by their modules (`payhook.gateways.GATEWAYS`), not
-- listed in the database: adding one adds a module and no migration. The
-- column keeps a name's shape; an endpoint whose gateway this release does
-- not know is not served (the ingress answers 404, the consumer records
-- `unknown_endpoint`).
--
-- Statement by statement: the new check is added NOT VALID (a catalog change
-- under the runner's lock_timeout) and validated under SHARE UPDATE
-- EXCLUSIVE, which lets the ingress and consumers read and write on. Every
-- statement is safe to run again.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                    WHERE conrelid = 'payhook.webhook_endpoints'::regclass
                      AND conname = 'webhook_endpoints_gateway_name') THEN
        ALTER TABLE payhook.webhook_endpoints
            ADD CONSTRAINT webhook_endpoints_gateway_name
            CHECK (gateway ~ '^[a-z][a-z0-9_]{0,31}$') NOT VALID;
    END IF;
END
$$;

ALTER TABLE payhook.webhook_endpoints VALIDATE CONSTRAINT webhook_endpoints_gateway_name;

ALTER TABLE payhook.webhook_endpoints DROP CONSTRAINT IF EXISTS webhook_endpoints_gateway_check;
