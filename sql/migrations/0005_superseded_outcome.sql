-- payhook: no-transaction
-- The `superseded` receipt outcome: a failed payment attempt delivered after
-- the payment that succeeded, which changes nothing.
--
-- As in 0003: the new check is added NOT VALID (ACCESS EXCLUSIVE, held only
-- for the catalog change) and validated under SHARE UPDATE EXCLUSIVE, so
-- consumers keep writing receipts meanwhile. Safe to run again.

ALTER TABLE payhook.payment_event_receipts
    DROP CONSTRAINT IF EXISTS payment_event_receipts_outcome_check,
    ADD CONSTRAINT payment_event_receipts_outcome_check CHECK (
        outcome IN (
            'processing', 'applied', 'already_applied', 'superseded', 'ignored',
            'amount_mismatch', 'currency_mismatch', 'identity_mismatch',
            'unmapped_order', 'invalid_transition', 'second_payment', 'malformed',
            'beyond_horizon'
        )
    ) NOT VALID;

ALTER TABLE payhook.payment_event_receipts
    VALIDATE CONSTRAINT payment_event_receipts_outcome_check;
