-- The tables of DESIGN.md, in schema payhook.
-- Every unique constraint of a tenant-owned table begins with tenant_id, so
-- the schema can be distributed by tenant. `tenants` is the tenant itself and
-- `security_anomalies` can precede knowing a tenant (a forged job naming an
-- unknown endpoint); both stay local tables.

create schema if not exists payhook;

create table payhook.tenants (
    id uuid primary key,
    name text not null check (name <> ''),
    -- Where the outbox worker POSTs fulfilment; null means the log handler.
    fulfilment_url text,
    -- Standard Webhooks secret (whsec_...) that signs our deliveries to the tenant.
    signing_secret text not null,
    created_at timestamptz not null default now()
);

create table payhook.webhook_endpoints (
    tenant_id uuid not null references payhook.tenants (id),
    id uuid not null,
    gateway text not null check (gateway in ('standard', 'stripe')),
    -- Active secrets, newest first; several during a rotation.
    secrets text[] not null check (cardinality(secrets) >= 1),
    created_at timestamptz not null default now(),
    rotated_at timestamptz,
    primary key (tenant_id, id)
);
-- The ingress and the consumer look an endpoint up by its id alone (the URL).
create index webhook_endpoints_id on payhook.webhook_endpoints (id);

create table payhook.payment_orders (
    tenant_id uuid not null references payhook.tenants (id),
    id uuid not null,
    merchant_reference text not null check (merchant_reference <> ''),
    gateway_order_id text not null check (gateway_order_id <> ''),
    amount_minor bigint not null check (amount_minor > 0),
    currency text not null check (currency ~ '^[A-Z]{3}$'),
    state text not null default 'pending' check (
        state in ('pending', 'paid', 'failed', 'partially_refunded', 'refunded', 'disputed')
    ),
    refunded_minor bigint not null default 0 check (refunded_minor >= 0 and refunded_minor <= amount_minor),
    created_at timestamptz not null default now(),
    updated_at timestamptz not null default now(),
    primary key (tenant_id, id),
    constraint payment_orders_merchant_reference_key unique (tenant_id, merchant_reference),
    constraint payment_orders_gateway_order_id_key unique (tenant_id, gateway_order_id)
);

create table payhook.payment_event_receipts (
    tenant_id uuid not null references payhook.tenants (id),
    event_id text not null,
    -- Null while unmapped: an authentic event that names no order of the tenant.
    order_id uuid,
    event_type text not null,
    payload_sha256 text not null check (payload_sha256 ~ '^[0-9a-f]{64}$'),
    received_at timestamptz not null default now(),
    processed_at timestamptz,
    endpoint_id uuid not null,
    gateway text not null,
    delivery_id uuid not null,
    occurred_at timestamptz,
    outcome text not null default 'processing' check (
        outcome in (
            'processing', 'applied', 'already_applied', 'ignored',
            'amount_mismatch', 'currency_mismatch', 'identity_mismatch',
            'unmapped_order', 'invalid_transition', 'second_payment', 'malformed'
        )
    ),
    primary key (tenant_id, event_id)
);
create index payment_event_receipts_received_at on payhook.payment_event_receipts (received_at);

create table payhook.payment_order_transitions (
    tenant_id uuid not null,
    id bigint generated always as identity,
    order_id uuid not null,
    event_id text not null,
    from_state text not null,
    to_state text not null,
    amount_minor bigint not null,
    created_at timestamptz not null default now(),
    primary key (tenant_id, id),
    -- One transition per event, whatever happens to the receipt.
    constraint payment_order_transitions_event_key unique (tenant_id, event_id),
    foreign key (tenant_id, order_id) references payhook.payment_orders (tenant_id, id)
);
create index payment_order_transitions_order on payhook.payment_order_transitions (tenant_id, order_id);

create table payhook.payment_outbox (
    id uuid not null,
    tenant_id uuid not null,
    order_id uuid not null,
    event_id text not null,
    action text not null,
    -- The body the handler sends: safe identifiers only.
    payload jsonb not null,
    created_at timestamptz not null default now(),
    delivered_at timestamptz,
    state text not null default 'pending' check (state in ('pending', 'delivered', 'dead')),
    attempts integer not null default 0,
    next_attempt_at timestamptz not null default now(),
    claimed_until timestamptz,
    claim_token uuid,
    last_error text,
    primary key (tenant_id, id),
    constraint payment_outbox_action_key unique (tenant_id, event_id, action),
    foreign key (tenant_id, order_id) references payhook.payment_orders (tenant_id, id)
);
create index payment_outbox_due on payhook.payment_outbox (next_attempt_at) where state = 'pending';

-- Wake outbox workers when the consumer's transaction commits new rows.
create function payhook.notify_outbox() returns trigger language plpgsql as $$
begin
    perform pg_notify('payhook_outbox', '');
    return null;
end;
$$;
create trigger payment_outbox_notify after insert on payhook.payment_outbox
    for each statement execute function payhook.notify_outbox();

create table payhook.payment_exceptions (
    tenant_id uuid not null,
    id bigint generated always as identity,
    event_id text not null,
    order_id uuid,
    kind text not null,
    -- Safe metadata: identifiers, amounts and states, never the payload.
    detail jsonb not null default '{}',
    -- The normalized event, so an operator can re-apply it once fixed.
    event jsonb not null,
    created_at timestamptz not null default now(),
    resolved_at timestamptz,
    primary key (tenant_id, id)
);
create index payment_exceptions_open on payhook.payment_exceptions (created_at) where resolved_at is null;

create table payhook.security_anomalies (
    id bigint generated always as identity primary key,
    tenant_id uuid,
    event_id text,
    endpoint_id uuid,
    delivery_id uuid,
    kind text not null check (kind in ('digest_conflict', 'signature_invalid', 'unknown_endpoint', 'malformed_job')),
    stored_sha256 text,
    received_sha256 text,
    detected_at timestamptz not null default now()
);
create index security_anomalies_detected_at on payhook.security_anomalies (detected_at);
