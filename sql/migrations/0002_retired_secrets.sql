-- Secrets retired from an endpoint, each with when it was retired. The
-- ingress stops accepting a secret the moment it is retired, but jobs it
-- accepted before then may still wait in the queue (or the dead-letter queue):
-- the consumer keeps verifying those against the secrets that were active when
-- they were received. Adding a column with a constant default rewrites
-- nothing, so this is safe on a live table.
ALTER TABLE payhook.webhook_endpoints
    ADD COLUMN retired_secrets jsonb NOT NULL DEFAULT '[]'::jsonb;
