"""The decision rules of the consumer transaction (`payhook.decide_v1`)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from consumer.rules import Order, decide
from payhook.db import Row, connect
from payhook.gateways import Event
from tests.conftest import created_database, test_settings

Connection = psycopg.Connection[Row]


@pytest.fixture(scope="module")
def conn(template_db: str) -> Iterator[Connection]:
    """The rules are a pure function: one database serves the whole module."""
    with created_database(template_db) as name, connect(test_settings(name), "test") as c:
        yield c


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
    conn: Connection, kind: str, state: str, amount: int, outcome: str, to_state: str | None
) -> None:
    decision = decide(conn, event(kind, amount), [order(state)])
    assert (decision.outcome, decision.to_state) == (outcome, to_state)


def test_partial_refunds_add_up_to_refunded(conn: Connection) -> None:
    decision = decide(conn, event("refunded", 600), [order("partially_refunded", refunded=400)])
    assert (decision.to_state, decision.refunded_minor, decision.action) == (
        "refunded",
        1000,
        "notify_refund",
    )
    over = decide(conn, event("refunded", 700), [order("partially_refunded", refunded=400)])
    assert over.outcome == "amount_mismatch"


def test_cumulative_refund_total_is_not_added_twice(conn: Connection) -> None:
    stripe_total = event("refunded", 400, cumulative=True)
    assert decide(conn, stripe_total, [order("paid")]).refunded_minor == 400
    assert (
        decide(conn, stripe_total, [order("partially_refunded", refunded=400)]).outcome
        == "already_applied"
    )
    assert (
        decide(
            conn, event("refunded", 1000, cumulative=True), [order("partially_refunded", 400)]
        ).to_state
        == "refunded"
    )


def test_identity_rules(conn: Connection) -> None:
    assert decide(conn, event(), []).outcome == "unmapped_order"
    assert decide(conn, event(), [order(), order()]).outcome == "identity_mismatch"
    assert decide(conn, event(merchant_reference="ref-2"), [order()]).outcome == "identity_mismatch"
    assert decide(conn, event(gateway_order_id="pi_2"), [order()]).outcome == "identity_mismatch"
    assert decide(conn, event(gateway_order_id="pi_2"), [order("paid")]).outcome == "second_payment"
    assert decide(conn, event(merchant_reference=None), [order()]).outcome == "applied"
    assert decide(conn, event(currency="USD"), [order()]).outcome == "currency_mismatch"


def test_paid_asks_for_fulfilment(conn: Connection) -> None:
    decision = decide(conn, event(), [order()])
    assert decision.action == "fulfil_order" and not decision.is_exception
    assert decide(conn, event(amount=1), [order()]).is_exception


def test_each_applied_kind_asks_for_its_side_effect(conn: Connection) -> None:
    cases = [
        (event("succeeded"), order("pending"), "fulfil_order"),
        (event("failed"), order("pending"), "notify_payment_failed"),
        (event("refunded", 400), order("paid"), "notify_refund"),
        (event("refunded", 400), order("disputed"), "notify_refund"),
        (event("disputed"), order("partially_refunded", refunded=400), "notify_dispute"),
    ]
    for sent, current, action in cases:
        decision = decide(conn, sent, [current])
        assert (decision.outcome, decision.action) == ("applied", action), (sent, current)
    assert decide(conn, event("failed"), [order("paid")]).action is None


def test_a_refund_delivered_after_the_dispute_still_counts(conn: Connection) -> None:
    """Refunded before the dispute, delivered after it: the order stays
    disputed and the refund is recorded, once (Stripe's total repeats)."""
    stripe_total = event("refunded", 400, cumulative=True)
    first = decide(conn, stripe_total, [order("disputed")])
    assert (first.outcome, first.to_state, first.refunded_minor, first.action) == (
        "applied",
        "disputed",
        400,
        "notify_refund",
    )
    again = decide(conn, stripe_total, [order("disputed", refunded=400)])
    assert again.outcome == "already_applied"
    more = decide(conn, event("refunded", 1000, cumulative=True), [order("disputed", refunded=400)])
    assert (more.to_state, more.refunded_minor) == ("disputed", 1000)
    standard = decide(conn, event("refunded", 700), [order("disputed", refunded=400)])
    assert standard.outcome == "amount_mismatch"
