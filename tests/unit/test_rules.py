"""The decision rules of the consumer transaction."""

from __future__ import annotations

import pytest

from consumer.rules import Order, decide
from payhook.gateways import Event


def order(state: str = "pending", refunded: int = 0) -> Order:
    return Order("o1", "ref-1", "pi_1", 1000, "EUR", state, refunded)


def event(kind: str | None = "succeeded", amount: int = 1000, **kw: object) -> Event:
    values: dict[str, object] = {
        "event_id": "e1",
        "event_type": f"payment.{kind}",
        "kind": kind,
        "occurred_at": None,
        "gateway_order_id": "pi_1",
        "merchant_reference": "ref-1",
        "amount_minor": amount,
        "currency": "EUR",
        "digest": "0" * 64,
    }
    return Event(**(values | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "state", "amount", "outcome", "to_state"),
    [
        ("succeeded", "pending", 1000, "applied", "paid"),
        ("succeeded", "failed", 1000, "applied", "paid"),
        ("succeeded", "pending", 999, "amount_mismatch", None),
        ("succeeded", "paid", 1000, "already_applied", None),
        ("failed", "pending", 1000, "applied", "failed"),
        ("failed", "paid", 1000, "superseded", None),
        ("failed", "partially_refunded", 1000, "superseded", None),
        ("failed", "refunded", 1000, "superseded", None),
        ("failed", "disputed", 1000, "superseded", None),
        ("failed", "failed", 1000, "already_applied", None),
        ("refunded", "paid", 400, "applied", "partially_refunded"),
        ("refunded", "paid", 1000, "applied", "refunded"),
        ("refunded", "paid", 1001, "amount_mismatch", None),
        ("refunded", "pending", 1000, "invalid_transition", None),
        ("refunded", "failed", 1000, "invalid_transition", None),
        ("refunded", "disputed", 400, "applied", "disputed"),
        ("disputed", "paid", 1000, "applied", "disputed"),
        ("disputed", "pending", 1000, "invalid_transition", None),
        ("disputed", "disputed", 1000, "already_applied", None),
    ],
)
def test_transitions(
    kind: str, state: str, amount: int, outcome: str, to_state: str | None
) -> None:
    decision = decide(event(kind, amount), [order(state)])
    assert (decision.outcome, decision.to_state) == (outcome, to_state)


def test_partial_refunds_add_up_to_refunded() -> None:
    decision = decide(event("refunded", 600), [order("partially_refunded", refunded=400)])
    assert (decision.to_state, decision.refunded_minor, decision.action) == (
        "refunded",
        1000,
        "notify_refund",
    )
    over = decide(event("refunded", 700), [order("partially_refunded", refunded=400)])
    assert over.outcome == "amount_mismatch"


def test_cumulative_refund_total_is_not_added_twice() -> None:
    stripe_total = event("refunded", 400, cumulative=True)
    assert decide(stripe_total, [order("paid")]).refunded_minor == 400
    assert (
        decide(stripe_total, [order("partially_refunded", refunded=400)]).outcome
        == "already_applied"
    )
    assert (
        decide(
            event("refunded", 1000, cumulative=True), [order("partially_refunded", 400)]
        ).to_state
        == "refunded"
    )


def test_identity_rules() -> None:
    assert decide(event(), []).outcome == "unmapped_order"
    assert decide(event(), [order(), order()]).outcome == "identity_mismatch"
    assert decide(event(merchant_reference="ref-2"), [order()]).outcome == "identity_mismatch"
    assert decide(event(gateway_order_id="pi_2"), [order()]).outcome == "identity_mismatch"
    assert decide(event(gateway_order_id="pi_2"), [order("paid")]).outcome == "second_payment"
    assert decide(event(merchant_reference=None), [order()]).outcome == "applied"
    assert decide(event(currency="USD"), [order()]).outcome == "currency_mismatch"


def test_paid_asks_for_fulfilment() -> None:
    decision = decide(event(), [order()])
    assert decision.action == "fulfil_order" and not decision.is_exception
    assert decide(event(amount=1), [order()]).is_exception


def test_each_applied_kind_asks_for_its_side_effect() -> None:
    cases = [
        (event("succeeded"), order("pending"), "fulfil_order"),
        (event("failed"), order("pending"), "notify_payment_failed"),
        (event("refunded", 400), order("paid"), "notify_refund"),
        (event("refunded", 400), order("disputed"), "notify_refund"),
        (event("disputed"), order("partially_refunded", refunded=400), "notify_dispute"),
    ]
    for sent, current, action in cases:
        decision = decide(sent, [current])
        assert (decision.outcome, decision.action) == ("applied", action), (sent, current)
    assert decide(event("failed"), [order("paid")]).action is None


def test_a_refund_delivered_after_the_dispute_still_counts() -> None:
    """Refunded before the dispute, delivered after it: the order stays
    disputed and the refund is recorded, once (Stripe's total repeats)."""
    stripe_total = event("refunded", 400, cumulative=True)
    first = decide(stripe_total, [order("disputed")])
    assert (first.outcome, first.to_state, first.refunded_minor, first.action) == (
        "applied",
        "disputed",
        400,
        "notify_refund",
    )
    again = decide(stripe_total, [order("disputed", refunded=400)])
    assert again.outcome == "already_applied"
    more = decide(event("refunded", 1000, cumulative=True), [order("disputed", refunded=400)])
    assert (more.to_state, more.refunded_minor) == ("disputed", 1000)
    standard = decide(event("refunded", 700), [order("disputed", refunded=400)])
    assert standard.outcome == "amount_mismatch"
