-- payhook: no-transaction
-- The receipt archive, the report of historical duplicates that a new unique
-- rule would reject, and the `beyond_horizon` receipt outcome.
--
-- Outside a transaction, statement by statement, so that the outcome check is
-- validated under SHARE UPDATE EXCLUSIVE (consumers keep writing) instead of
-- the ACCESS EXCLUSIVE lock that replacing it takes, which is held only for
-- the catalog change. Every statement is safe to run again.

-- What retention keeps of a receipt once it leaves the live table: enough to
-- recognise a redelivery (identity and digest) and prove how it was handled.
CREATE TABLE IF NOT EXISTS payhook.payment_event_receipts_archive (
    tenant_id uuid NOT NULL,
    event_id text NOT NULL,
    -- sha256 of the business content, as 32 bytes.
    payload_sha256 bytea NOT NULL CHECK (octet_length(payload_sha256) = 32),
    outcome text NOT NULL,
    occurred_at timestamptz,
    received_at timestamptz NOT NULL,
    processed_at timestamptz,
    archived_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, event_id)
);

-- One row per group of rows that share the key of a unique rule about to be
-- built (`payhook uniqueness check`). `redelivery`: the rows agree on every
-- column but bookkeeping, the same event recorded twice, and
-- `payhook uniqueness resolve` keeps the first; `distinct`: legitimate rows
-- the rule would forbid, for an operator to decide.
CREATE TABLE IF NOT EXISTS payhook.uniqueness_conflicts (
    tenant_id uuid NOT NULL,
    rule text NOT NULL,
    table_name text NOT NULL,
    -- The shared values of the rule's columns after tenant_id.
    key jsonb NOT NULL,
    copies integer NOT NULL CHECK (copies > 1),
    versions integer NOT NULL CHECK (versions >= 1),
    classification text NOT NULL CHECK (classification IN ('redelivery', 'distinct')),
    -- Columns left out when comparing the rows: ids, arrival stamps, bookkeeping.
    ignored text[] NOT NULL DEFAULT '{}',
    found_at timestamptz NOT NULL DEFAULT now(),
    checked_at timestamptz NOT NULL DEFAULT now(),
    resolved_at timestamptz,
    PRIMARY KEY (tenant_id, rule, key)
);

-- The surplus copies `payhook uniqueness resolve` took out of a table, whole,
-- so that collapsing a redelivery never destroys evidence.
CREATE TABLE IF NOT EXISTS payhook.uniqueness_quarantine (
    tenant_id uuid NOT NULL,
    id bigint GENERATED ALWAYS AS IDENTITY,
    rule text NOT NULL,
    table_name text NOT NULL,
    key jsonb NOT NULL,
    row_data jsonb NOT NULL,
    quarantined_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, id)
);

-- Retention deletes delivered outbox rows by age without scanning pending ones.
CREATE INDEX CONCURRENTLY IF NOT EXISTS payment_outbox_delivered_at
    ON payhook.payment_outbox (delivered_at) WHERE state = 'delivered';

ALTER TABLE payhook.payment_event_receipts
    DROP CONSTRAINT IF EXISTS payment_event_receipts_outcome_check,
    ADD CONSTRAINT payment_event_receipts_outcome_check CHECK (
        outcome IN (
            'processing', 'applied', 'already_applied', 'ignored',
            'amount_mismatch', 'currency_mismatch', 'identity_mismatch',
            'unmapped_order', 'invalid_transition', 'second_payment', 'malformed',
            'beyond_horizon'
        )
    ) NOT VALID;

ALTER TABLE payhook.payment_event_receipts
    VALIDATE CONSTRAINT payment_event_receipts_outcome_check;
