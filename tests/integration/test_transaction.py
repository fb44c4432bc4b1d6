"""The consumer transaction against real PostgreSQL."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import pq
from psycopg.types.json import Jsonb

from consumer.handler import CLOCK_SKEW, Runtime, handle
from consumer.rules import EXCEPTION_OUTCOMES, Decision, Order
from consumer.transaction import apply_event
from payhook import counters
from payhook.db import Row, create_pool
from payhook.endpoints import Endpoint
from payhook.envelope import ENVELOPE_VERSION, NewerEnvelope
from payhook.gateways import get_gateway
from payhook.sealing import endpoint_aad
from payhook.settings import Settings
from tests.factories import (
    TEST_KEYRING,
    Factory,
    Shop,
    StandardEvent,
    envelope,
    stripe_body,
    stripe_headers,
)
from tests.locks import released_after
from tests.protocol import protocol_trace, sent


def apply(runtime: Runtime, factory: Factory, shop: Shop, event: StandardEvent) -> str:
    return handle(runtime, factory.standard_envelope(shop, event).to_json()).outcome


def retirement_grace(runtime: Runtime) -> timedelta:
    """How long after its retirement a secret still verifies jobs received then."""
    return timedelta(seconds=runtime.settings.endpoint_refresh) + CLOCK_SKEW


def test_valid_payment_is_applied_once(runtime: Runtime, factory: Factory) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent()
    assert apply(runtime, factory, shop, event) == "applied"
    assert apply(runtime, factory, shop, event) == "duplicate"
    assert factory.order_state(shop, order_id) == "paid"
    assert factory.count("payment_event_receipts", outcome="applied") == 1
    assert factory.count("payment_order_transitions", order_id=order_id, to_state="paid") == 1
    assert factory.count("payment_outbox", order_id=order_id, action="fulfil_order") == 1


def test_an_event_is_applied_in_one_statement_and_one_round_trip(
    runtime: Runtime, factory: Factory
) -> None:
    """The seven steps run on the server: one Sync from the worker, for a first
    delivery and for a duplicate alike, and the connection left idle."""
    shop = factory.shop()
    factory.order(shop)
    job = factory.standard_envelope(shop, StandardEvent())
    event = get_gateway("standard").parse(job.headers, job.body)
    endpoint = Endpoint(shop.endpoint_id, shop.tenant_id, "standard", (shop.secret,))
    with runtime.pool.connection() as conn:
        for expected in ("applied", "duplicate"):
            with protocol_trace(conn) as trace:
                result = apply_event(conn, endpoint, event, job.delivery_id)
            assert result.outcome == expected
            assert sent(trace).count("Sync") == 1, trace
            assert sent(trace).count("Execute") == 1, trace
            assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert factory.count("payment_outbox") == 1


def test_a_duplicate_never_locks_the_order(factory: Factory, settings: Settings) -> None:
    """A redelivery, or the same job run again, answers at once while another
    transaction holds the order, and leaves no lock of its own on the row
    (its transaction writes nothing)."""
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent()
    job = factory.standard_envelope(shop, event).to_json()
    # Any statement, a lock wait included, is cancelled after a second.
    pool = create_pool(settings, "test", size=1, statement_timeout=1.0)
    pool.open(wait=True)
    strict = Runtime(settings=settings, pool=pool)
    try:
        assert handle(strict, job).outcome == "applied"
        locker = _order_xmax(factory, order_id)
        redelivery = factory.standard_envelope(shop, event).to_json()
        for again in (job, redelivery):
            assert handle(strict, again).outcome == "duplicate"
            assert _order_xmax(factory, order_id) == locker, "the duplicate locked the order"
        with psycopg.connect(settings.database_url) as holder:
            holder.execute(
                "SELECT 1 FROM payhook.payment_orders WHERE id = %s FOR UPDATE", (order_id,)
            )
            for again in (job, redelivery):
                assert handle(strict, again).outcome == "duplicate"
    finally:
        pool.close()
    assert factory.count("payment_order_transitions", order_id=order_id) == 1


def test_a_transition_whose_order_did_not_move_fails_the_transaction(
    conn: psycopg.Connection[Row], factory: Factory
) -> None:
    """Were the order's state ever not the one decided on, the write statement
    writes nothing and raises: nothing is recorded as applied."""
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent()
    job = factory.standard_envelope(shop, event)
    parsed = get_gateway("standard").parse(job.headers, job.body)
    # The order is pending; the transition is written as if it were failed.
    stale = Order(order_id, "order-1", "pi_1", 1999, "EUR", state="failed", refunded_minor=0)
    receipt = {
        "tenant_id": shop.tenant_id,
        "event_id": parsed.event_id,
        "event_type": parsed.event_type,
        "digest": parsed.digest,
        "endpoint_id": shop.endpoint_id,
        "gateway": "standard",
        "delivery_id": job.delivery_id,
        "occurred_at": parsed.occurred_at,
    }
    with pytest.raises(psycopg.errors.RaiseException, match="did not move"), conn.transaction():
        conn.execute(
            "INSERT INTO payhook.payment_event_receipts (tenant_id, event_id, event_type,"
            " payload_sha256, endpoint_id, gateway, delivery_id, occurred_at)"
            " VALUES (%(tenant_id)s, %(event_id)s, %(event_type)s, %(digest)s,"
            " %(endpoint_id)s, %(gateway)s, %(delivery_id)s, %(occurred_at)s)",
            receipt,
        )
        decision = Decision("applied", to_state="paid", refunded_minor=0, action="fulfil_order")
        # Steps 5 to 7 as both entry points run them, on the server.
        conn.execute(
            "SELECT payhook.write_transition_v1(%s, %s, %s, %s, %s, %s)",
            (
                shop.tenant_id,
                Jsonb(parsed.to_json()),
                Jsonb(dataclasses.asdict(stale)),
                decision.to_state,
                decision.refunded_minor,
                decision.action,
            ),
        )
    assert factory.order_state(shop, order_id) == "pending"
    assert factory.count("payment_event_receipts") == 0
    assert factory.count("payment_outbox", order_id=order_id) == 0


def _order_xmax(factory: Factory, order_id: str) -> str:
    """The id of the last transaction that updated or locked the order's row."""
    row = factory.conn.execute(
        "SELECT xmax::text AS xmax FROM payhook.payment_orders WHERE id = %s", (order_id,)
    ).fetchone()
    assert row is not None
    return str(row["xmax"])


def test_twenty_threads_apply_one_event_once(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    """20 threads, each with its own connection, deliver the same event at once."""
    shop = factory.shop()
    order_id = factory.order(shop)
    job = factory.standard_envelope(shop, StandardEvent()).to_json()
    pool = create_pool(settings, "test", size=20)
    pool.open(wait=True)
    threaded = Runtime(settings=settings, pool=pool)
    barrier = threading.Barrier(20)
    outcomes: list[str] = []

    def deliver() -> None:
        barrier.wait()
        outcomes.append(handle(threaded, job).outcome)

    threads = [threading.Thread(target=deliver) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    pool.close()
    assert not any(t.is_alive() for t in threads), "a delivery did not finish in bounded time"
    assert Counter(outcomes) == {"applied": 1, "duplicate": 19}
    assert factory.count("payment_event_receipts") == 1
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert factory.count("payment_outbox", order_id=order_id) == 1


@pytest.mark.parametrize(
    ("change", "outcome"),
    [
        ({"amount": 1000}, "amount_mismatch"),
        ({"currency": "USD"}, "currency_mismatch"),
        ({"merchant_reference": "order-2"}, "identity_mismatch"),
        ({"merchant_reference": "nobody", "gateway_order_id": "pi_nobody"}, "unmapped_order"),
    ],
)
def test_invalid_event_changes_nothing_and_records_one_exception(
    runtime: Runtime, factory: Factory, change: dict[str, object], outcome: str
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    factory.order(shop, merchant_reference="order-2", gateway_order_id="pi_2")
    event = StandardEvent(**change)  # type: ignore[arg-type]
    assert apply(runtime, factory, shop, event) == outcome
    assert apply(runtime, factory, shop, event) == "duplicate"
    assert factory.order_state(shop, order_id) == "pending"
    assert factory.count("payment_outbox") == 0
    assert factory.count("payment_order_transitions") == 0
    assert factory.count("payment_exceptions", kind=outcome, event_id=event.event_id) == 1
    assert factory.count("payment_event_receipts", outcome=outcome) == 1


def test_same_event_id_with_other_content_is_an_anomaly_without_effect(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    first = StandardEvent(type="payment.failed")
    assert apply(runtime, factory, shop, first) == "applied"
    forged = StandardEvent(event_id=first.event_id, type="payment.succeeded")
    assert apply(runtime, factory, shop, forged) == "digest_conflict"
    assert factory.order_state(shop, order_id) == "failed"
    assert factory.count("security_anomalies", kind="digest_conflict", event_id=first.event_id) == 1
    assert factory.count("payment_outbox", action="fulfil_order") == 0
    row = factory.conn.execute(
        "SELECT stored_sha256, received_sha256 FROM payhook.security_anomalies"
    ).fetchone()
    assert row is not None and row["stored_sha256"] != row["received_sha256"]


def test_stripe_redelivery_differing_in_pending_webhooks_is_a_plain_duplicate(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop("stripe")
    order_id = factory.order(shop)
    first = stripe_body(event_id="evt_1", pending_webhooks=2)
    again = stripe_body(event_id="evt_1", pending_webhooks=1)
    assert first != again
    outcomes = [
        handle(runtime, envelope(shop, body, stripe_headers(shop.secret, body)).to_json()).outcome
        for body in (first, again)
    ]
    assert outcomes == ["applied", "duplicate"]
    assert factory.count("security_anomalies") == 0
    assert factory.order_state(shop, order_id) == "paid"


def rendered_for_another_api_version(body: bytes) -> bytes:
    """The same Stripe event as an endpoint pinned to another API version
    receives it: other fields beside the same identifiers, amounts and status."""
    event = json.loads(body)
    event["api_version"] = "2020-08-27"
    obj = event["data"]["object"]
    obj["charges"] = {"object": "list", "data": [{"id": "ch_1"}]}
    obj["review"] = None
    return json.dumps(event).encode()


def test_a_stripe_event_rendered_for_two_api_versions_is_a_duplicate_not_a_conflict(
    runtime: Runtime, factory: Factory
) -> None:
    """Same id, same meaning, other JSON: a duplicate. Same id and another
    amount: a conflict, whatever the rendering."""
    shop = factory.shop("stripe")
    order_id = factory.order(shop)

    def apply(body: bytes) -> str:
        job = envelope(shop, body, stripe_headers(shop.secret, body))
        return handle(runtime, job.to_json()).outcome

    first = stripe_body(event_id="evt_v", amount=1999)
    other = rendered_for_another_api_version(first)
    assert apply(first) == "applied"
    assert apply(other) == "duplicate"
    assert factory.count("security_anomalies") == 0
    assert factory.order_state(shop, order_id) == "paid"
    receipt = factory.conn.execute(
        "SELECT payload_sha256, meaning_sha256 FROM payhook.payment_event_receipts"
        " WHERE event_id = 'evt_v'"
    ).fetchone()
    assert receipt is not None and receipt["payload_sha256"] != receipt["meaning_sha256"]

    changed = json.loads(other)
    changed["data"]["object"]["amount"] = 1
    changed["data"]["object"]["amount_received"] = 1
    assert apply(json.dumps(changed).encode()) == "digest_conflict"
    assert factory.count("security_anomalies", kind="digest_conflict") == 1


def test_a_receipt_from_before_meanings_is_compared_by_its_payload_digest(
    runtime: Runtime, factory: Factory
) -> None:
    """A receipt written by the release before keeps no meaning: its repeats
    are compared as they were, by the payload digest."""
    shop = factory.shop("stripe")
    factory.order(shop)

    def apply(body: bytes) -> str:
        job = envelope(shop, body, stripe_headers(shop.secret, body))
        return handle(runtime, job.to_json()).outcome

    first = stripe_body(event_id="evt_old", pending_webhooks=2)
    assert apply(first) == "applied"
    factory.conn.execute("UPDATE payhook.payment_event_receipts SET meaning_sha256 = NULL")
    assert apply(stripe_body(event_id="evt_old", pending_webhooks=1)) == "duplicate"
    assert factory.count("security_anomalies") == 0
    assert apply(rendered_for_another_api_version(first)) == "digest_conflict"


def test_an_archived_receipt_keeps_its_meaning_for_late_repeats(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop("stripe")
    factory.order(shop)

    def apply(body: bytes) -> str:
        job = envelope(shop, body, stripe_headers(shop.secret, body))
        return handle(runtime, job.to_json()).outcome

    first = stripe_body(event_id="evt_arch")
    assert apply(first) == "applied"
    moved = factory.conn.execute(
        "SELECT moved FROM payhook.retention_archive_receipts_v1(now() + interval '1 day', 10)"
    ).fetchone()
    assert moved == {"moved": 1}
    assert apply(rendered_for_another_api_version(first)) == "duplicate"
    assert factory.count("security_anomalies") == 0
    assert factory.count("payment_event_receipts") == 0, "the archived identity stays archived"


def test_two_gateway_payments_for_one_order_fulfil_once_and_raise_one_exception(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    assert apply(runtime, factory, shop, StandardEvent()) == "applied"
    second = StandardEvent(gateway_order_id="pi_second")
    assert apply(runtime, factory, shop, second) == "second_payment"
    assert factory.count("payment_outbox", action="fulfil_order", order_id=order_id) == 1
    assert factory.count("payment_exceptions", kind="second_payment") == 1


def test_same_gateway_payment_under_a_new_event_id_is_a_no_op(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop()
    factory.order(shop)
    assert apply(runtime, factory, shop, StandardEvent()) == "applied"
    assert apply(runtime, factory, shop, StandardEvent()) == "already_applied"
    assert factory.count("payment_outbox") == 1
    assert factory.count("payment_exceptions") == 0


#: Receipt outcomes that change nothing and raise no exception.
QUIET_OUTCOMES = {"already_applied", "superseded", "ignored"}


def test_the_outcomes_that_raise_exceptions_are_the_same_in_sql_and_python(
    runtime: Runtime, factory: Factory
) -> None:
    """`apply_event_v2` decides on the server which outcomes record an
    exception; `consumer.rules.EXCEPTION_OUTCOMES` says it for replays and
    the operations commands. Every outcome the receipts' check allows is
    recorded once here, and raises an exception exactly when Python says so."""
    row = factory.conn.execute(
        "SELECT pg_get_constraintdef(oid) AS def FROM pg_constraint"
        " WHERE conname = 'payment_event_receipts_outcome_check'"
    ).fetchone()
    assert row is not None
    allowed = set(re.findall(r"'([a-z_]+)'::text", row["def"])) - {"processing", "applied"}
    assert allowed == EXCEPTION_OUTCOMES | QUIET_OUTCOMES
    shop = factory.shop()
    factory.order(shop)
    endpoint = Endpoint(shop.endpoint_id, shop.tenant_id, "standard", (shop.secret,))
    gateway = get_gateway("standard")
    with runtime.pool.connection() as conn:
        for outcome in sorted(allowed):
            job = factory.standard_envelope(shop, StandardEvent())
            event = gateway.parse(job.headers, job.body)
            result = apply_event(conn, endpoint, event, job.delivery_id, forced_outcome=outcome)
            assert result.outcome == outcome
            raised = factory.count("payment_exceptions", event_id=event.event_id, kind=outcome)
            assert raised == (outcome in EXCEPTION_OUTCOMES), outcome
    assert factory.count("payment_exceptions") == len(EXCEPTION_OUTCOMES)
    assert factory.count("payment_order_transitions") == 0


def test_unknown_event_type_is_recorded_and_ignored(runtime: Runtime, factory: Factory) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    assert apply(runtime, factory, shop, StandardEvent(type="customer.updated")) == "ignored"
    assert factory.count("payment_event_receipts", outcome="ignored") == 1
    assert factory.order_state(shop, order_id) == "pending"


def test_event_on_tenant_a_naming_tenant_b_changes_nothing_of_b(
    runtime: Runtime, factory: Factory
) -> None:
    shop_a, shop_b = factory.shop(), factory.shop()
    order_b = factory.order(shop_b, merchant_reference="b-1", gateway_order_id="pi_b")
    event = StandardEvent(merchant_reference="b-1", gateway_order_id="pi_b")
    event.extra = {"tenant_id": shop_b.tenant_id}
    assert apply(runtime, factory, shop_a, event) == "unmapped_order"
    assert factory.order_state(shop_b, order_b) == "pending"
    assert factory.count("payment_event_receipts", tenant_id=shop_b.tenant_id) == 0
    assert factory.count("payment_exceptions", tenant_id=shop_a.tenant_id) == 1


def test_job_with_a_body_the_endpoint_never_signed_applies_nothing(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent()
    signed = factory.standard_envelope(shop, event)
    forged = envelope(shop, event.body().replace(b"1999", b"1"), dict(signed.headers))
    assert handle(runtime, forged.to_json()).outcome == "signature_invalid"
    assert factory.count("security_anomalies", kind="signature_invalid") == 1
    assert factory.count("payment_event_receipts") == 0
    assert factory.order_state(shop, order_id) == "pending"


def test_malformed_job_and_unknown_endpoint_are_anomalies(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop()
    assert handle(runtime, {"v": 1, "endpoint_id": "nope"}).outcome == "malformed_job"
    stray = factory.standard_envelope(shop, StandardEvent())
    stray = envelope(shop, stray.body, dict(stray.headers))
    object.__setattr__(stray, "endpoint_id", "00000000-0000-4000-8000-000000000000")
    assert handle(runtime, stray.to_json()).outcome == "unknown_endpoint"
    kinds = {r["kind"] for r in factory.conn.execute("SELECT kind FROM payhook.security_anomalies")}
    assert kinds == {"malformed_job", "unknown_endpoint"}


def test_an_envelope_from_a_newer_ingress_fails_the_job_instead_of_being_dropped(
    runtime: Runtime, factory: Factory
) -> None:
    """Acknowledged at the ingress, so never recorded as malformed: RQ retries it and
    keeps it in the dead-letter queue until consumers that read it requeue it."""
    shop = factory.shop()
    newer = factory.standard_envelope(shop, StandardEvent()).to_json() | {"v": ENVELOPE_VERSION + 1}
    with pytest.raises(NewerEnvelope):
        handle(runtime, newer)
    assert factory.count("security_anomalies") == 0
    assert factory.count("payment_event_receipts") == 0
    assert handle(runtime, {"v": True}).outcome == "malformed_job"


def test_a_version_1_envelope_queued_before_an_upgrade_is_applied(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop()
    factory.order(shop)
    data = factory.standard_envelope(shop, StandardEvent()).to_json()
    body = data.pop("body").encode()
    old = data | {"v": 1, "body_b64": base64.b64encode(body).decode()}
    assert handle(runtime, old).outcome == "applied"
    assert factory.count("payment_order_transitions") == 1


def test_authentic_but_unreadable_body_is_kept_as_an_exception(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop()
    event = StandardEvent()
    body = b'{"type": "payment.succeeded", "data": {"amount": "lots"}}'
    job = envelope(shop, body, event.headers(shop.secret, body))
    assert handle(runtime, job.to_json()).outcome == "malformed"
    assert (
        factory.count("payment_event_receipts", outcome="malformed", event_id=event.event_id) == 1
    )
    assert factory.count("payment_exceptions", kind="malformed") == 1


def test_stripe_redelivery_of_an_unreadable_event_is_a_duplicate_not_a_conflict(
    runtime: Runtime, factory: Factory
) -> None:
    """Stripe rewrites `pending_webhooks` and `request` on each delivery: an
    event payhook cannot read is digested without them too."""
    shop = factory.shop("stripe")
    bodies = []
    for pending in (2, 1):
        data = json.loads(stripe_body(event_id="evt_unreadable", pending_webhooks=pending))
        data["data"]["object"]["amount"] = data["data"]["object"]["amount_received"] = "lots"
        bodies.append(json.dumps(data).encode())
    assert bodies[0] != bodies[1]
    outcomes = [
        handle(runtime, envelope(shop, body, stripe_headers(shop.secret, body)).to_json()).outcome
        for body in bodies
    ]
    assert outcomes == ["malformed", "duplicate"]
    assert factory.count("security_anomalies") == 0
    assert factory.count("payment_exceptions", kind="malformed") == 1


def test_a_refund_before_its_payment_waits_then_applies_once_the_payment_does(
    runtime: Runtime, factory: Factory
) -> None:
    """Kept as an exception, never dropped; replayed, once, by the consumer
    that moves the order. A redelivery of either changes nothing more."""
    shop = factory.shop()
    order_id = factory.order(shop)
    refund = StandardEvent(type="payment.refunded", amount=500)
    assert apply(runtime, factory, shop, refund) == "invalid_transition"
    assert factory.order_state(shop, order_id) == "pending"
    payment = StandardEvent()
    assert apply(runtime, factory, shop, payment) == "applied"
    assert factory.order_state(shop, order_id) == "partially_refunded"
    rows = factory.conn.execute(
        "SELECT kind, detail->>'resolution' AS resolution FROM payhook.payment_exceptions"
        " WHERE resolved_at IS NOT NULL"
    ).fetchall()
    assert rows == [{"kind": "invalid_transition", "resolution": "replay:applied"}]
    assert (apply(runtime, factory, shop, refund), apply(runtime, factory, shop, payment)) == (
        "duplicate",
        "duplicate",
    )
    assert factory.count("payment_outbox", action="fulfil_order") == 1
    assert factory.count("payment_outbox", action="notify_refund") == 1
    assert factory.count("payment_order_transitions") == 2


#: Refund and payment pairs raced at most; about 3 in 10 refunds lose the race
#: and are parked. The races go on until 3 have been, and at least 15 ran.
RACES = 100


def test_a_refund_racing_its_payment_is_applied_once_whichever_commits_first(
    runtime: Runtime, factory: Factory
) -> None:
    """The refund either sees the payment, or is parked before the payment's
    lock is taken and the payment's consumer finds it: never left behind."""
    shop = factory.shop()
    parked = races = 0
    while races < RACES and (parked < 3 or races < 15):
        i = races = races + 1
        order_id = factory.order(shop, f"race-{i}", f"pi_race_{i}")
        pair = [
            StandardEvent(type="payment.refunded", merchant_reference=f"race-{i}",
                          gateway_order_id=f"pi_race_{i}", amount=500),
            StandardEvent(merchant_reference=f"race-{i}", gateway_order_id=f"pi_race_{i}"),
        ]  # fmt: skip
        barrier = threading.Barrier(2)
        outcomes: dict[str, str] = {}

        def deliver(
            event: StandardEvent, barrier: threading.Barrier, outcomes: dict[str, str]
        ) -> None:
            barrier.wait()
            outcomes[event.type] = apply(runtime, factory, shop, event)

        threads = [threading.Thread(target=deliver, args=(e, barrier, outcomes)) for e in pair]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive()
        assert outcomes["payment.succeeded"] == "applied"
        assert outcomes["payment.refunded"] in ("applied", "invalid_transition")
        assert factory.order_state(shop, order_id) == "partially_refunded", outcomes
        parked += outcomes["payment.refunded"] == "invalid_transition"
    print(f"{parked} of {races} refunds were parked, then replayed")
    assert parked, "the race went one way only: nothing was parked (about 3 in 10 are)"
    assert factory.count("payment_outbox", action="notify_refund") == races
    assert factory.count("payment_exceptions") == factory.count(
        "payment_exceptions", kind="invalid_transition"
    )
    open_ = factory.conn.execute(
        "SELECT count(*) AS n FROM payhook.payment_exceptions WHERE resolved_at IS NULL"
    ).fetchone()
    assert open_ == {"n": 0}


def test_early_events_that_still_cannot_apply_stay_parked_and_the_rest_apply(
    runtime: Runtime, factory: Factory
) -> None:
    """Replayed oldest first once the payment applies: a dispute and a refund
    apply; a refund of more than was paid waits for an operator."""
    shop = factory.shop()
    order_id = factory.order(shop)
    events = [
        StandardEvent(type="payment.disputed"),
        StandardEvent(type="payment.refunded", amount=5000),
        StandardEvent(type="payment.refunded", amount=500),
    ]
    assert [apply(runtime, factory, shop, e) for e in events] == ["invalid_transition"] * 3
    assert apply(runtime, factory, shop, StandardEvent()) == "applied"
    row = factory.order_totals(order_id)
    assert row == {"state": "disputed", "refunded_minor": 500}
    still = factory.conn.execute(
        "SELECT event_id FROM payhook.payment_exceptions WHERE resolved_at IS NULL"
    ).fetchall()
    assert [r["event_id"] for r in still] == [events[1].event_id]


def test_events_delivered_out_of_order_are_applied_as_they_happened(
    runtime: Runtime, factory: Factory
) -> None:
    """Stripe does not promise order. A refund made before a dispute and
    delivered after it still counts (once, however often it comes); a failed
    attempt delivered after the payment that succeeded changes nothing and
    opens no exception."""
    shop = factory.shop("stripe")
    order_id = factory.order(shop)

    def deliver(body: bytes) -> str:
        job = envelope(shop, body, stripe_headers(shop.secret, body))
        return handle(runtime, job.to_json()).outcome

    refund = stripe_body("charge.refunded", amount=500)
    sequence = [
        stripe_body(),
        stripe_body("payment_intent.payment_failed"),
        stripe_body("charge.dispute.created", amount=1499),
        refund,
        refund,
    ]
    outcomes = [deliver(body) for body in sequence]
    assert outcomes == ["applied", "superseded", "applied", "applied", "duplicate"]
    order = factory.order_totals(order_id)
    assert order == {"state": "disputed", "refunded_minor": 500}
    outbox = factory.conn.execute(
        "SELECT action, payload FROM payhook.payment_outbox WHERE order_id = %s"
        " ORDER BY created_at",
        (order_id,),
    ).fetchall()
    assert [row["action"] for row in outbox] == ["fulfil_order", "notify_dispute", "notify_refund"]
    assert (outbox[-1]["payload"]["amount_minor"], outbox[-1]["payload"]["state"]) == (
        500,
        "disputed",
    )
    transitions = factory.conn.execute(
        "SELECT from_state, to_state, amount_minor FROM payhook.payment_order_transitions"
        " WHERE order_id = %s ORDER BY id",
        (order_id,),
    ).fetchall()
    assert [tuple(row.values()) for row in transitions] == [
        ("pending", "paid", 1999),
        ("paid", "disputed", 1499),
        ("disputed", "disputed", 500),
    ]
    assert factory.count("payment_exceptions") == 0


def test_a_stripe_payment_captured_in_part_does_not_pay_the_order(
    runtime: Runtime, factory: Factory
) -> None:
    shop = factory.shop("stripe")
    order_id = factory.order(shop)
    body = stripe_body(amount=1999, received=1000)
    job = envelope(shop, body, stripe_headers(shop.secret, body))
    assert handle(runtime, job.to_json()).outcome == "amount_mismatch"
    assert factory.order_state(shop, order_id) == "pending"
    assert factory.count("payment_outbox", order_id=order_id) == 0
    assert factory.count("payment_exceptions", kind="amount_mismatch") == 1


def test_stripe_charges_without_a_payment_intent_reach_their_order_or_an_exception(
    runtime: Runtime, factory: Factory
) -> None:
    """An order taken with the Charges API is known by its charge: its refund
    and its dispute (no PaymentIntent) apply to it. A dispute of a charge no
    order has is `unmapped_order` with the identifiers it carried; a
    reference of Stripe's longest metadata value still finds its order."""
    shop = factory.shop("stripe")
    reference = "r" * 500
    order_id = factory.order(shop, reference, "ch_legacy")

    def apply(body: bytes) -> str:
        job = envelope(shop, body, stripe_headers(shop.secret, body))
        return handle(runtime, job.to_json()).outcome

    # Paid as the Charges API pays (`charge.succeeded`, which payhook does not map).
    factory.conn.execute(
        "UPDATE payhook.payment_orders SET state = 'paid' WHERE id = %s", (order_id,)
    )
    refund = stripe_body(
        "charge.refunded", payment_intent=None, charge="ch_legacy", order_ref=reference, amount=700
    )
    assert apply(refund) == "applied"
    assert factory.order_totals(order_id) == {"state": "partially_refunded", "refunded_minor": 700}
    dispute = stripe_body(
        "charge.dispute.created", payment_intent=None, charge="ch_legacy", order_ref=None
    )
    assert apply(dispute) == "applied"
    assert factory.order_state(shop, order_id) == "disputed"

    stranger = stripe_body(
        "charge.dispute.created",
        event_id="evt_x",
        payment_intent=None,
        charge="ch_other",
        order_ref=None,
    )
    assert apply(stranger) == "unmapped_order"
    row = factory.conn.execute(
        "SELECT detail FROM payhook.payment_exceptions WHERE event_id = 'evt_x'"
    ).fetchone()
    assert row == {"detail": {"gateway_order_id": "ch_other", "merchant_reference": None}}


def test_each_refund_notification_carries_that_refund_whatever_the_gateway_reports(
    runtime: Runtime, factory: Factory
) -> None:
    """Stripe reports the charge's refunded total, Standard Webhooks each refund:
    the outbox payload and the audit row carry this refund's amount either way,
    and the payload the order's refunded total beside it."""
    results = {}
    for gateway in ("stripe", "standard"):
        shop = factory.shop(gateway)
        order_id = factory.order(shop)
        if gateway == "stripe":
            bodies = [
                stripe_body(),
                *(stripe_body("charge.refunded", amount=a) for a in (500, 800)),
            ]
            jobs = [envelope(shop, body, stripe_headers(shop.secret, body)) for body in bodies]
        else:
            events = [
                StandardEvent(),
                *(StandardEvent(type="payment.refunded", amount=a) for a in (500, 300)),
            ]
            jobs = [factory.standard_envelope(shop, event) for event in events]
        assert [handle(runtime, job.to_json()).outcome for job in jobs] == ["applied"] * 3
        payloads = factory.conn.execute(
            "SELECT payload FROM payhook.payment_outbox"
            " WHERE order_id = %s AND action = 'notify_refund' ORDER BY created_at",
            (order_id,),
        ).fetchall()
        audited = factory.conn.execute(
            "SELECT amount_minor FROM payhook.payment_order_transitions"
            " WHERE order_id = %s AND to_state LIKE '%%refunded' ORDER BY created_at",
            (order_id,),
        ).fetchall()
        results[gateway] = (
            [(p["payload"]["amount_minor"], p["payload"]["refunded_minor"]) for p in payloads],
            [a["amount_minor"] for a in audited],
        )
    assert results["stripe"] == results["standard"] == ([(500, 500), (300, 800)], [500, 300])


def test_serialization_failures_are_retried_a_bounded_number_of_times(
    runtime: Runtime, factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import consumer.transaction as tx

    shop = factory.shop()
    factory.order(shop)
    calls = {"n": 0}
    real = tx.apply_call

    def flaky(*args: object, **kwargs: object) -> tx.Applied:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise psycopg.errors.SerializationFailure("could not serialize access")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tx, "apply_call", flaky)
    result = handle(runtime, factory.standard_envelope(shop, StandardEvent()).to_json())
    assert (result.outcome, result.retries) == ("applied", 2)
    assert runtime.redis is not None
    assert counters.total(runtime.redis, counters.SERIALIZATION_RETRIES, 300) == 2

    calls["n"] = -100
    with pytest.raises(tx.TooManyRetries):
        handle(runtime, factory.standard_envelope(shop, StandardEvent()).to_json())
    assert calls["n"] == -100 + runtime.settings.serialization_retries + 1
    retries = 2 + runtime.settings.serialization_retries + 1
    assert counters.total(runtime.redis, counters.SERIALIZATION_RETRIES, 300) == retries


def test_consumer_follows_secret_rotation(runtime: Runtime, factory: Factory) -> None:
    """A secret rotated in verifies at once; a retired one stops once the cache expires."""
    from control import admin

    shop = factory.shop()
    factory.order(shop)
    assert apply(runtime, factory, shop, StandardEvent(type="customer.created")) == "ignored"
    old = shop.secret
    shop.secret = admin.rotate_endpoint_secret(factory.conn, shop.endpoint_id, keyring=TEST_KEYRING)
    assert apply(runtime, factory, shop, StandardEvent(type="customer.created")) == "ignored"
    admin.retire_old_secrets(factory.conn, shop.endpoint_id)
    runtime.endpoints.ttl = 0
    shop.secret = old
    received_later = dataclasses.replace(
        factory.standard_envelope(shop, StandardEvent(type="customer.created")),
        received_at=datetime.now(UTC) + retirement_grace(runtime) + timedelta(seconds=5),
    )
    assert handle(runtime, received_later.to_json()).outcome == "signature_invalid"


@pytest.mark.parametrize("gateway", ["standard", "stripe"])
def test_a_null_written_among_the_secrets_by_hand_never_breaks_verification(
    runtime: Runtime, factory: Factory, gateway: str
) -> None:
    """Only SQL by hand can put a NULL among an endpoint's secrets: active,
    retired at the end of a rotation, or first in the list, it is passed over
    and the real secrets still verify."""
    from control import admin

    shop = factory.shop(gateway)
    factory.conn.execute(
        "UPDATE payhook.webhook_endpoints"
        " SET secrets = array_prepend(NULL::text, array_append(secrets, NULL)) WHERE id = %s",
        (shop.endpoint_id,),
    )
    runtime.endpoints.ttl = 0

    def deliver() -> str:
        if gateway == "standard":
            return apply(runtime, factory, shop, StandardEvent(type="customer.created"))
        body = stripe_body("customer.created")
        return handle(
            runtime, envelope(shop, body, stripe_headers(shop.secret, body)).to_json()
        ).outcome

    assert deliver() == "ignored"
    admin.retire_old_secrets(factory.conn, shop.endpoint_id)
    row = factory.conn.execute(
        "SELECT secrets, retired_secrets FROM payhook.webhook_endpoints WHERE id = %s",
        (shop.endpoint_id,),
    ).fetchone()
    assert row is not None
    aad = endpoint_aad(shop.tenant_id, shop.endpoint_id)
    assert [TEST_KEYRING.open(s, aad) for s in row["secrets"]] == [shop.secret]
    assert all(isinstance(r["secret"], str) for r in row["retired_secrets"])
    assert deliver() == "ignored"


def test_pooled_connections_the_server_ended_are_not_handed_to_a_job(
    runtime: Runtime, factory: Factory
) -> None:
    """After a restart, a failover or an administrator, the pool still holds
    connections the server ended: a job must not fail on one (on its last
    retry, or requeued from the dead-letter queue, it would go back there
    with its event never applied)."""
    shop = factory.shop()
    factory.order(shop, "order-1", "pi_1")
    factory.order(shop, "order-2", "pi_2")
    first = StandardEvent(merchant_reference="order-1", gateway_order_id="pi_1")
    assert apply(runtime, factory, shop, first) == "applied"
    with runtime.pool.connection() as one, runtime.pool.connection() as two:
        pids = [c.info.backend_pid for c in (one, two)]
    factory.end_backends(pids)  # both idle in the pool
    second = StandardEvent(merchant_reference="order-2", gateway_order_id="pi_2")
    assert apply(runtime, factory, shop, second) == "applied"
    assert factory.count("payment_event_receipts", outcome="applied") == 2
    with runtime.pool.connection() as fresh:
        assert fresh.info.backend_pid not in pids


def test_job_timeout_while_waiting_on_a_lock_cancels_the_statement(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    """RQ's timeout interrupts a job blocked on a row lock: the job must end then,
    not when the lock is released, and leave no transaction behind."""
    from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty

    shop = factory.shop()
    order_id = factory.order(shop)
    job = factory.standard_envelope(shop, StandardEvent()).to_json()
    with psycopg.connect(str(settings.database_url)) as holder:
        holder.execute("SELECT 1 FROM payhook.payment_orders WHERE id = %s FOR UPDATE", (order_id,))
        with released_after(holder) as released_by_watchdog:
            with pytest.raises(JobTimeoutException), UnixSignalDeathPenalty(1, JobTimeoutException):
                handle(runtime, job)
        assert not released_by_watchdog.is_set(), "the job waited for the lock holder"
        holder.rollback()
    assert factory.count("payment_event_receipts") == 0, "the interrupted transaction rolled back"
    assert handle(runtime, job).outcome == "applied"


def test_job_received_before_its_secret_was_retired_is_still_applied(
    runtime: Runtime, factory: Factory
) -> None:
    """Retiring a secret must not turn events already acknowledged into anomalies."""
    from control import admin

    shop = factory.shop()
    order_id = factory.order(shop)
    queued = factory.standard_envelope(shop, StandardEvent())  # received, not yet consumed
    admin.rotate_endpoint_secret(factory.conn, shop.endpoint_id, keyring=TEST_KEYRING)
    admin.retire_old_secrets(factory.conn, shop.endpoint_id)
    runtime.endpoints.ttl = 0
    assert handle(runtime, queued.to_json()).outcome == "applied"
    assert factory.order_state(shop, order_id) == "paid"
    # Received just after the retirement, by an ingress whose endpoint cache
    # had not caught up yet (or whose clock runs a little ahead): accepted.
    just_after = factory.standard_envelope(shop, StandardEvent(type="customer.created"))
    assert handle(runtime, just_after.to_json()).outcome == "ignored"
    late = dataclasses.replace(
        factory.standard_envelope(shop, StandardEvent(type="customer.created")),
        received_at=datetime.now(UTC) + retirement_grace(runtime) + timedelta(seconds=5),
    )
    assert handle(runtime, late.to_json()).outcome == "signature_invalid"
