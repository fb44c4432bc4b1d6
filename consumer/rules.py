"""What one authentic event does to one locked order: a pure decision.

The transaction (`consumer.transaction`) locks the order and then asks
`decide` what to do; nothing here touches the database, so every rule is
tested directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from payhook.gateways import Event

#: Outcomes that write a `payment_exceptions` row: authentic but not applicable.
EXCEPTION_OUTCOMES = frozenset(
    {
        "amount_mismatch",
        "currency_mismatch",
        "identity_mismatch",
        "unmapped_order",
        "invalid_transition",
        "second_payment",
        "malformed",
        "beyond_horizon",
    }
)

#: The side effect an applied event of each kind asks the outbox worker to
#: perform (a refund of a disputed order moves no state, and still notifies).
ACTIONS = {
    "succeeded": "fulfil_order",
    "failed": "notify_payment_failed",
    "refunded": "notify_refund",
    "disputed": "notify_dispute",
}

#: States from which a payment counts as taken.
_CAPTURED = frozenset({"paid", "partially_refunded", "refunded", "disputed"})


@dataclass(frozen=True)
class Order:
    id: str
    merchant_reference: str
    gateway_order_id: str
    amount_minor: int
    currency: str
    state: str
    refunded_minor: int


@dataclass(frozen=True)
class Decision:
    """The outcome, and for `applied` the transition and its side effect."""

    outcome: str
    to_state: str | None = None
    refunded_minor: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    action: str | None = None

    @property
    def is_exception(self) -> bool:
        return self.outcome in EXCEPTION_OUTCOMES


def decide(event: Event, orders: list[Order]) -> Decision:
    """The decision for `event` given the orders its identifiers mapped to."""
    if not orders:
        return Decision("unmapped_order", detail=_identity(event))
    if len(orders) > 1:
        return Decision(
            "identity_mismatch",
            detail=_identity(event) | {"orders": [o.id for o in orders]},
        )
    order = orders[0]
    if (
        event.merchant_reference is not None
        and event.merchant_reference != order.merchant_reference
    ):
        return Decision("identity_mismatch", detail=_identity(event, order))
    if event.gateway_order_id != order.gateway_order_id:
        if event.kind == "succeeded" and order.state in _CAPTURED:
            # A different gateway payment for an order already paid: money was
            # taken twice, which operations must refund.
            return Decision("second_payment", detail=_identity(event, order))
        return Decision("identity_mismatch", detail=_identity(event, order))
    if event.currency != order.currency:
        return Decision(
            "currency_mismatch",
            detail={"expected": order.currency, "received": event.currency, "state": order.state},
        )
    assert event.amount_minor is not None
    if event.kind == "succeeded":
        return _succeeded(event.amount_minor, order)
    if event.kind == "failed":
        return _failed(event.amount_minor, order)
    if event.kind == "refunded":
        return _refunded(event, order)
    if event.kind == "disputed":
        return _disputed(event.amount_minor, order)
    raise ValueError(f"no rule for event kind {event.kind!r}")


def _succeeded(amount: int, order: Order) -> Decision:
    if order.state in _CAPTURED:
        return Decision("already_applied", detail={"state": order.state})
    if amount != order.amount_minor:
        return _amount_mismatch(order, amount)
    return _applied("succeeded", "paid", order.refunded_minor)


def _failed(amount: int, order: Order) -> Decision:
    if order.state == "failed":
        return Decision("already_applied", detail={"state": order.state})
    if order.state in _CAPTURED:
        # A failed attempt delivered after the payment that succeeded: gateways
        # do not promise order, and the failure changes nothing now.
        return Decision("superseded", detail={"state": order.state})
    if order.state != "pending":
        return _invalid(order, "failed")
    if amount != order.amount_minor:
        return _amount_mismatch(order, amount)
    return _applied("failed", "failed", order.refunded_minor)


def _refunded(event: Event, order: Order) -> Decision:
    assert event.amount_minor is not None
    if event.cumulative:
        total = event.amount_minor
        if order.refunded_minor and total <= order.refunded_minor:
            return Decision("already_applied", detail={"state": order.state})
    else:
        total = order.refunded_minor + event.amount_minor
    if order.state not in {"paid", "partially_refunded", "disputed"}:
        return _invalid(order, "refunded")
    if total > order.amount_minor or total <= order.refunded_minor:
        return _amount_mismatch(order, event.amount_minor, refunded=order.refunded_minor)
    if order.state == "disputed":
        # A refund made before the dispute and delivered after it: the money
        # went back all the same. The order stays disputed; the refund counts.
        return _applied("refunded", "disputed", total)
    to_state = "refunded" if total == order.amount_minor else "partially_refunded"
    return _applied("refunded", to_state, total)


def _disputed(amount: int, order: Order) -> Decision:
    if order.state == "disputed":
        return Decision("already_applied", detail={"state": order.state})
    if order.state not in {"paid", "partially_refunded", "refunded"}:
        return _invalid(order, "disputed")
    if amount > order.amount_minor or amount <= 0:
        return _amount_mismatch(order, amount)
    return _applied("disputed", "disputed", order.refunded_minor)


def _applied(kind: str, to_state: str, refunded_minor: int) -> Decision:
    return Decision(
        "applied", to_state=to_state, refunded_minor=refunded_minor, action=ACTIONS[kind]
    )


def _amount_mismatch(order: Order, received: int, **extra: int) -> Decision:
    detail = {"expected": order.amount_minor, "received": received, "state": order.state}
    return Decision("amount_mismatch", detail=detail | extra)


def _invalid(order: Order, towards: str) -> Decision:
    return Decision("invalid_transition", detail={"state": order.state, "towards": towards})


def _identity(event: Event, order: Order | None = None) -> dict[str, Any]:
    detail: dict[str, Any] = {
        "merchant_reference": event.merchant_reference,
        "gateway_order_id": event.gateway_order_id,
    }
    if order is not None:
        detail["order"] = {
            "merchant_reference": order.merchant_reference,
            "gateway_order_id": order.gateway_order_id,
            "state": order.state,
        }
    return detail
