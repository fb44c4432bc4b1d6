-- payhook: no-transaction
-- Dead outbox rows, found without scanning the delivered ones: the
-- `outbox_dead` alert, `payhook outbox list --state dead` and
-- `payhook outbox retry-dead` read only these. Built concurrently, so
-- consumers keep writing the table meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_outbox_dead
    ON payhook.payment_outbox (created_at) WHERE state = 'dead';
