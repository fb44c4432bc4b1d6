-- payhook: no-transaction
-- The open exceptions of one order, found without reading every open one:
-- after a consumer moves an order, it looks for events of that order that
-- arrived too early (a refund before its payment) to replay them. Built
-- concurrently, so consumers keep writing the table meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_exceptions_open_order
    ON payhook.payment_exceptions (tenant_id, order_id) WHERE resolved_at IS NULL;
