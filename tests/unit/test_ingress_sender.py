"""`payhook send` signs what a gateway would send, as the gateways' own libraries check it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import stripe as stripe_sdk
from standardwebhooks.webhooks import Webhook

from control.sender import Event, send_copies, sign_event
from payhook.gateways import get_gateway, standard
from payhook.gateways import stripe as stripe_gateway

STANDARD_SECRET = standard.generate_secret()
STRIPE_SECRET = stripe_gateway.generate_secret()


def test_standard_event_verifies_with_the_standardwebhooks_library() -> None:
    event = Event("standard", "payment.succeeded", "pi_9", 2500, "eur", "order-9", "msg_fixed")
    request = sign_event(event, STANDARD_SECRET)
    payload = Webhook(STANDARD_SECRET).verify(request.body, request.headers)
    assert payload["data"] == {
        "gateway_order_id": "pi_9",
        "merchant_reference": "order-9",
        "amount": 2500,
        "currency": "EUR",
    }
    parsed = get_gateway("standard").parse(request.headers, request.body)
    assert (parsed.event_id, parsed.kind, parsed.amount_minor) == ("msg_fixed", "succeeded", 2500)


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [
        ("payment_intent.succeeded", "succeeded"),
        ("payment_intent.payment_failed", "failed"),
        ("charge.refunded", "refunded"),
        ("charge.dispute.created", "disputed"),
    ],
)
def test_stripe_events_verify_with_the_stripe_library(event_type: str, kind: str) -> None:
    event = Event("stripe", event_type, "pi_42", 1999, "EUR", "order-42")
    request = sign_event(event, STRIPE_SECRET)
    header = request.headers["stripe-signature"]
    constructed = stripe_sdk.Webhook.construct_event(request.body, header, STRIPE_SECRET)
    assert constructed["type"] == event_type
    parsed = get_gateway("stripe").parse(request.headers, request.body)
    assert parsed.event_id == request.event_id == constructed["id"]
    assert (parsed.kind, parsed.gateway_order_id) == (kind, "pi_42")
    assert (parsed.merchant_reference, parsed.amount_minor, parsed.currency) == (
        "order-42",
        1999,
        "EUR",
    )


def test_copies_send_the_same_signed_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[bytes, dict[str, str]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.content, dict(request.headers)))
        return httpx.Response(202, json={"delivery_id": f"d{len(seen)}"})

    event = Event("standard", "payment.succeeded", "pi_1", 100, "EUR", event_id="msg_storm")
    signed = sign_event(event, STANDARD_SECRET, timestamp=int(time.time()))
    results = asyncio.run(
        send_copies("http://ingress/webhooks/x", signed, 5, 2, httpx.MockTransport(answer))
    )
    assert len(seen) == 5 and len({body for body, _ in seen}) == 1
    assert {headers["webhook-id"] for _, headers in seen} == {"msg_storm"}
    assert sorted(result["copy"] for result in results) == [1, 2, 3, 4, 5]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {line["status"] for line in lines} == {202} and len(lines) == 5


def test_refusals_and_connection_errors_are_reported_per_copy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.headers["webhook-id"] == "msg_down":
            raise httpx.ConnectError("refused")
        return httpx.Response(503, json={"error": "unavailable"}, headers={"retry-after": "5"})

    for event_id in ("msg_refused", "msg_down"):
        event = Event("standard", "payment.succeeded", "pi_1", 100, "EUR", event_id=event_id)
        asyncio.run(
            send_copies(
                "http://ingress/webhooks/x",
                sign_event(event, STANDARD_SECRET),
                1,
                1,
                httpx.MockTransport(answer),
            )
        )
    refused, down = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert refused["status"] == 503 and refused["retry_after"] == "5"
    assert "ConnectError" in down["error"] and "status" not in down


@pytest.mark.parametrize(
    ("gateway", "event_type"),
    [
        ("standard", "payment.succeeded"),
        ("stripe", "payment_intent.succeeded"),
        ("stripe", "charge.refunded"),
        ("stripe", "charge.dispute.created"),
    ],
)
def test_sending_a_given_event_id_again_is_a_redelivery_not_new_content(
    gateway: str, event_type: str
) -> None:
    """A gateway's redelivery repeats the event's content: so does a second
    `payhook send --event-id`, signed later, else payhook would see other
    content under the same id (a digest conflict, a security alert)."""
    secret = STANDARD_SECRET if gateway == "standard" else STRIPE_SECRET
    adapter = get_gateway(gateway)

    def digest(event: Event, at: int) -> str:
        signed = sign_event(event, secret, timestamp=at)
        return adapter.parse(signed.headers, signed.body).digest

    now = 1_796_040_000  # 2026-11-30T12:00:00Z: the same UTC day seven seconds on
    given = Event(gateway, event_type, "pi_1", 500, "EUR", "order-1", event_id="evt_again")
    assert digest(given, now) == digest(given, now + 7)
    if gateway == "stripe":  # the id is in a Stripe body, object ids derive from it
        other = Event(gateway, event_type, "pi_1", 500, "EUR", "order-1", event_id="evt_other")
        assert digest(other, now) != digest(given, now)
    fresh = Event(gateway, event_type, "pi_1", 500, "EUR", "order-1")
    assert digest(fresh, now) != digest(fresh, now + 7), "a new event each time"
    stated = Event(gateway, event_type, "pi_1", 500, "EUR", "order-1", "evt_again", 1_700_000_000)
    signed = sign_event(stated, secret, timestamp=now)
    occurred_at = adapter.parse(signed.headers, signed.body).occurred_at
    assert occurred_at is not None
    assert occurred_at.timestamp() == 1_700_000_000
