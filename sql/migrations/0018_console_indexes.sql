-- payhook: no-transaction
-- The operators' console pages its lists on indexes, newest first, never
-- reading a whole table: every exception (resolved ones too) by time, one
-- tenant's by time, overdue outbox rows by time, orders by either of their
-- references across tenants, and reconciliation runs by time. Built
-- concurrently, so consumers keep writing the tables meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_exceptions_created
    ON payhook.payment_exceptions (created_at, id);
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_exceptions_tenant_created
    ON payhook.payment_exceptions (tenant_id, created_at, id);
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_outbox_pending_created
    ON payhook.payment_outbox (created_at, id) WHERE state = 'pending';
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_orders_merchant_reference
    ON payhook.payment_orders (merchant_reference);
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_orders_gateway_order_id
    ON payhook.payment_orders (gateway_order_id);
CREATE INDEX CONCURRENTLY IF NOT EXISTS reconcile_runs_started
    ON payhook.reconcile_runs (started_at, id);
