"""What became of an event or a job: every name payhook records, in one place.

Python takes its lists from here. The database keeps copies it cannot take
from Python: the CHECK constraints that migrations wrote, and the rules in
`payhook.decide_v1` and `payhook.apply_event_v1` (which outcomes record an
exception).

A job's outcome is a receipt outcome; `duplicate` or `digest_conflict` when
its event already had a receipt; or one of `REFUSED_OUTCOMES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

#: Receipt outcomes that record a `payment_exceptions` row of that kind: an
#: authentic event that could not be applied, kept for an operator.
EXCEPTION_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "amount_mismatch": "the amount is not the order's, or a refund would exceed it",
        "currency_mismatch": "the currency is not the order's",
        "identity_mismatch": "the identifiers disagree with the order's, or name several orders",
        "unmapped_order": "no order of the tenant carries either identifier",
        "invalid_transition": "the order's state does not allow it; replayed when the order moves",
        "second_payment": "another gateway payment for an order already paid",
        "malformed": "an authentic body payhook cannot read or store",
        "beyond_horizon": "dated before the receipt retention horizon, so never applied",
    }
)

#: Receipt outcomes that change nothing and record no exception.
QUIET_OUTCOMES: Mapping[str, str] = MappingProxyType(
    {
        "already_applied": "the order is already where the event would move it",
        "superseded": "a failed payment attempt delivered after the payment that succeeded",
        "ignored": "an event type payhook does not act on",
    }
)

#: Every outcome a receipt (`payment_event_receipts.outcome`) may hold.
RECEIPT_OUTCOMES: Mapping[str, str] = MappingProxyType(
    {
        "processing": "claimed; the column's default until its transaction records the outcome",
        "applied": "the order moved one state forward; its side effect is in the outbox",
        **QUIET_OUTCOMES,
        **EXCEPTION_KINDS,
    }
)

#: Kinds of `security_anomalies`: safe metadata of what payhook could not trust.
ANOMALY_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "digest_conflict": "an event id delivered again with other content",
        "signature_invalid": "a job that no secret of its endpoint verifies",
        "unknown_endpoint": "a job naming an endpoint that does not exist",
        "malformed_job": "a job whose envelope cannot be read",
    }
)

#: Outcomes of a job the consumer could not trust or read: each is recorded
#: as a security anomaly of that kind, applies nothing, and fails the job
#: into the dead-letter queue without retries.
REFUSED_OUTCOMES = frozenset({"signature_invalid", "unknown_endpoint", "malformed_job"})

#: Outcomes after which an event is accounted for: a replay that reaches one
#: closes the event's exception.
RESOLVING_OUTCOMES = frozenset({"applied", "already_applied", "superseded"})
