"""The horizon guard and events whose gateway timestamp it cannot read, against real PostgreSQL.

An event payhook acts on is judged by its gateway timestamp. One without a
readable timestamp could be of any age, so it is never applied: it is
recorded `malformed`, with an exception for an operator, and changes nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import psycopg
import pytest

from consumer.handler import Runtime, handle
from consumer.replay import NotReplayable, replay_exception
from consumer.transaction import apply_event
from payhook.db import Row
from payhook.endpoints import Endpoint
from payhook.gateways import Event
from payhook.horizon import DAY
from tests.factories import Factory, Shop, StandardEvent, envelope, stripe_body, stripe_headers

#: Long enough ago that the horizon would refuse it, had it a timestamp to judge.
OLD = int(time.time() - 500 * DAY)


def standard_job(shop: Shop, event: StandardEvent, timestamp: object) -> dict[str, Any]:
    """A signed job of `event` whose body's `timestamp` is `timestamp` (None: no such field)."""
    payload = json.loads(event.body())
    if timestamp is None:
        del payload["timestamp"]
    else:
        payload["timestamp"] = timestamp
    body = json.dumps(payload).encode()
    return envelope(shop, body, event.headers(shop.secret, body)).to_json()


def stripe_job(shop: Shop, created: object, event_type: str = "payment_intent.succeeded") -> Any:
    """A signed Stripe job whose `created` is `created` (None: no such field)."""
    data = json.loads(stripe_body(event_type))
    if created is None:
        del data["created"]
    else:
        data["created"] = created
    body = json.dumps(data).encode()
    return envelope(shop, body, stripe_headers(shop.secret, body)).to_json()


STANDARD_UNREADABLE = {
    "missing": None,
    "without_offset": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(OLD)),
    "epoch": OLD,
}
STRIPE_UNREADABLE = {"missing": None, "text": str(OLD), "fraction": OLD + 0.5}


def cases() -> list[Any]:
    return [
        *(pytest.param("standard", t, id=f"standard-{k}") for k, t in STANDARD_UNREADABLE.items()),
        *(pytest.param("stripe", t, id=f"stripe-{k}") for k, t in STRIPE_UNREADABLE.items()),
    ]


@pytest.mark.parametrize(("gateway", "timestamp"), cases())
def test_an_old_payment_without_a_readable_timestamp_is_never_applied(
    runtime: Runtime, factory: Factory, gateway: str, timestamp: object
) -> None:
    """Had it been applied, the horizon would never have judged it: an event
    of any age, a year-old payment included, would move its order."""
    shop = factory.shop(gateway)
    order_id = factory.order(shop)
    if gateway == "standard":
        job = standard_job(shop, StandardEvent(), timestamp)
    else:
        job = stripe_job(shop, timestamp)

    assert handle(runtime, job).outcome == "malformed"
    job["delivery_id"] = str(uuid.uuid4())
    assert handle(runtime, job).outcome == "duplicate", "a redelivery is a plain duplicate"

    assert factory.order_state(shop, order_id) == "pending"
    assert factory.count("payment_order_transitions") == 0
    assert factory.count("payment_outbox") == 0
    assert factory.count("payment_event_receipts", outcome="malformed") == 1
    assert factory.count("security_anomalies") == 0
    exceptions = factory.conn.execute(
        "SELECT id, kind, resolved_at FROM payhook.payment_exceptions"
    ).fetchall()
    assert [(e["kind"], e["resolved_at"]) for e in exceptions] == [("malformed", None)]
    with pytest.raises(NotReplayable, match="resolved by hand"):
        replay_exception(factory.conn, exceptions[0]["id"])
    assert factory.order_state(shop, order_id) == "pending"


@pytest.mark.parametrize("gateway", ["standard", "stripe"])
def test_a_type_payhook_ignores_needs_no_timestamp(
    runtime: Runtime, factory: Factory, gateway: str
) -> None:
    shop = factory.shop(gateway)
    if gateway == "standard":
        job = standard_job(shop, StandardEvent(type="customer.updated"), None)
    else:
        job = stripe_job(shop, None, event_type="customer.updated")
    assert handle(runtime, job).outcome == "ignored"
    assert factory.count("payment_event_receipts", outcome="ignored") == 1
    assert factory.count("payment_exceptions") == 0


@pytest.mark.parametrize("gateway", ["standard", "stripe"])
def test_a_payment_with_a_readable_timestamp_inside_the_horizon_is_applied(
    runtime: Runtime, factory: Factory, gateway: str
) -> None:
    shop = factory.shop(gateway)
    order_id = factory.order(shop)
    recent = int(time.time() - 30 * DAY)
    if gateway == "standard":
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(recent))
        job = standard_job(shop, StandardEvent(), stamp)
    else:
        job = stripe_job(shop, recent)
    assert handle(runtime, job).outcome == "applied"
    assert factory.order_state(shop, order_id) == "paid"


def test_the_transaction_refuses_an_event_to_act_on_that_has_no_timestamp(
    conn: psycopg.Connection[Row], factory: Factory
) -> None:
    """The gateways never produce one; were an adapter to, the transaction
    raises (the job is retried, then kept in the dead-letter queue) rather
    than apply an event the horizon cannot judge."""
    shop = factory.shop()
    order_id = factory.order(shop)
    endpoint = Endpoint(shop.endpoint_id, shop.tenant_id, "standard", (shop.secret,))
    event = Event(
        event_id="msg_untimed",
        event_type="payment.succeeded",
        kind="succeeded",
        occurred_at=None,
        gateway_order_id="pi_1",
        merchant_reference="order-1",
        amount_minor=1999,
        currency="EUR",
        digest="0" * 64,
    )
    with pytest.raises(ValueError, match="no gateway timestamp"):
        apply_event(conn, endpoint, event, str(uuid.uuid4()))
    assert factory.order_state(shop, order_id) == "pending"
    assert factory.count("payment_event_receipts") == 0
    ignored = Event.unreadable("msg_untimed_other", "customer.updated", "1" * 64)
    assert apply_event(conn, endpoint, ignored, str(uuid.uuid4())).outcome == "ignored"
