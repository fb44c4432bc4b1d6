"""Square, Checkout.com, Razorpay and Paddle: a keyed hash each, checked
against the gateway's own library (Checkout.com has none: its documented
rule) and its published vectors, in both directions."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import razorpay
from paddle_billing.Notifications import Secret, Verifier
from square.utils.webhooks_helper import verify_signature

from payhook.errors import MalformedHeaders, SignatureMismatch, TimestampOutOfTolerance
from payhook.gateways import get_gateway
from payhook.gateways.base import NO_CONFIG, Config, Gateway, Sample
from payhook.gateways.checkout import sign as checkout_sign

FIXTURES = Path(__file__).parents[1] / "fixtures"
NOW = int(time.time())


def fixture(gateway: str, name: str) -> bytes:
    return (FIXTURES / gateway / name).read_bytes()


def vectors(gateway: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(fixture(gateway, "vectors.json"))
    return data


def verify(
    gateway: Gateway,
    headers: dict[str, str],
    body: bytes,
    secrets: list[str],
    config: Config = NO_CONFIG,
    now: float | None = None,
) -> None:
    tolerance = gateway.tolerance if now is not None else None
    gateway.verify(headers, body, secrets, now=now, tolerance=tolerance, config=config)


def sample(event_type: str, amount: int = 1999, currency: str = "EUR") -> Sample:
    return Sample("evt_4f1c2b9a7d3e", event_type, "order-gw-1", amount, currency, "ref-1", NOW - 60)


# -- Square ---------------------------------------------------------------------------

SQUARE = get_gateway("square")


@pytest.mark.parametrize("vector", vectors("square"), ids=lambda v: v["name"])
def test_squares_published_vectors(vector: dict[str, Any]) -> None:
    config = Config({"notification_url": vector["notification_url"]})
    headers = {"x-square-hmacsha256-signature": vector["signature_header"]}
    body = vector["request_body"].encode()
    if vector["valid"]:
        verify(SQUARE, headers, body, [vector["signature_key"]], config)
    else:
        with pytest.raises((SignatureMismatch, MalformedHeaders)):
            verify(SQUARE, headers, body, [vector["signature_key"]], config)


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [
        ("payment.updated", "succeeded"),
        ("payment.updated:FAILED", "failed"),
        ("payment.updated:APPROVED", None),
        ("refund.updated", "refunded"),
        ("dispute.created", "disputed"),
    ],
)
def test_what_payhook_send_signs_squares_library_verifies(event_type: str, kind: str) -> None:
    url = "https://payhook.example/webhooks/e1"
    config = Config({"notification_url": url})
    body, headers = SQUARE.sample_request([sample(event_type)], "sq-key", NOW, config)
    signature = headers["x-square-hmacsha256-signature"]
    assert verify_signature(
        request_body=body.decode(),
        signature_header=signature,
        signature_key="sq-key",
        notification_url=url,
    )
    verify(SQUARE, headers, body, ["sq-key"], config)
    # Signed for another URL (a proxy rewrote it), or with another key: refused.
    with pytest.raises(SignatureMismatch):
        verify(SQUARE, headers, body, ["sq-key"], Config({"notification_url": url + "/"}))
    with pytest.raises(SignatureMismatch):
        verify(SQUARE, headers, body, ["other"], config)
    event = SQUARE.parse({}, body)
    assert event.kind == kind
    if kind:
        assert (event.gateway_order_id, event.amount_minor, event.currency) == (
            "order-gw-1",
            1999,
            "EUR",
        )


@pytest.mark.parametrize(
    ("name", "kind", "order"),
    [
        ("payment.updated.json", "succeeded", "hYy9pRFVxpDsO1FB05SunFWUe9JZY"),
        ("refund.updated.json", "refunded", "KkAkhdMsgzn59SM8A89WgKwekxLZY"),
        ("dispute.created.json", "disputed", "fbmsaEOpoARDKxiSGH1fqPuqoqFZY"),
        ("dispute.state.updated.json", None, None),
    ],
)
def test_squares_sample_events_map(name: str, kind: str | None, order: str | None) -> None:
    event = SQUARE.parse({}, fixture("square", name))
    assert (event.kind, event.gateway_order_id) == (kind, order)


def test_a_square_endpoint_needs_its_notification_url() -> None:
    with pytest.raises(ValueError, match="notification_url is required"):
        SQUARE.check_config(Config())
    with pytest.raises(SignatureMismatch):
        verify(SQUARE, {"x-square-hmacsha256-signature": "x"}, b"{}", ["k"])


# -- Checkout.com ----------------------------------------------------------------------

CHECKOUT = get_gateway("checkout")


@pytest.mark.parametrize(
    ("name", "kind", "order", "reference"),
    [
        ("payment_captured.json", "succeeded", "pay_waji5li3mqtetnaor77xmow4bq", "ORD-5023-4E89"),
        ("payment_declined.json", "failed", None, None),
        ("payment_refunded.json", "refunded", None, None),
        ("dispute_arbitration_won.json", None, None, None),
        ("dispute_canceled.json", None, None, None),
    ],
)
def test_checkouts_documented_events_verify_and_map(
    name: str, kind: str, order: str | None, reference: str | None
) -> None:
    body = fixture("checkout", name)
    headers = {"cko-signature": checkout_sign("sk_webhook", body)}
    verify(CHECKOUT, headers, body, ["old", "sk_webhook"])
    with pytest.raises(SignatureMismatch):
        verify(CHECKOUT, headers, body + b"\n", ["sk_webhook"])
    event = CHECKOUT.parse({}, body)
    assert event.kind == kind
    if order:
        assert (event.gateway_order_id, event.merchant_reference) == (order, reference)


def test_checkouts_dispute_maps_by_its_payment() -> None:
    data = json.loads(fixture("checkout", "dispute_evidence_required.data.json"))
    body = json.dumps(
        {
            "id": "evt_1",
            "type": "dispute_evidence_required",
            "created_on": "2026-12-01T10:00:00Z",
            "data": data,
        }
    ).encode()
    event = CHECKOUT.parse({}, body)
    assert event.kind == "disputed" and event.gateway_order_id == data["payment_id"]


def test_checkouts_authorization_header_when_configured() -> None:
    body, headers = CHECKOUT.sample_request(
        [sample("payment_captured")], "sk", NOW, Config({}, {"authorization": "static-value"})
    )
    config = Config({}, {"authorization": "static-value"})
    verify(CHECKOUT, headers, body, ["sk"], config)
    with pytest.raises(SignatureMismatch):
        verify(CHECKOUT, headers | {"authorization": "other"}, body, ["sk"], config)
    # Configured, but it did not open (held empty): nothing matches.
    with pytest.raises(SignatureMismatch):
        verify(CHECKOUT, headers, body, ["sk"], Config({}, {"authorization": ""}))


# -- Razorpay --------------------------------------------------------------------------

RAZORPAY = get_gateway("razorpay")


@pytest.mark.parametrize("vector", vectors("razorpay"), ids=lambda v: v["source"][:40])
def test_razorpays_published_vectors(vector: dict[str, Any]) -> None:
    body = (
        fixture("razorpay", vector["body_file"])
        if "body_file" in vector
        else vector["body"].encode()
    )
    headers = {"x-razorpay-signature": vector["signature"]}
    verify(RAZORPAY, headers, body, [vector["secret"]])
    razorpay.Utility().verify_webhook_signature(
        body.decode(), vector["signature"], vector["secret"]
    )
    with pytest.raises(SignatureMismatch):
        verify(RAZORPAY, headers, body, ["another"])


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [
        ("payment.captured", "succeeded"),
        ("payment.failed", "failed"),
        ("refund.processed", "refunded"),
        ("payment.dispute.created", "disputed"),
        ("payment.authorized", None),
    ],
)
def test_what_payhook_send_signs_razorpays_library_verifies(event_type: str, kind: str) -> None:
    body, headers = RAZORPAY.sample_request([sample(event_type, 50000, "INR")], "rzp", NOW)
    razorpay.Utility().verify_webhook_signature(
        body.decode(), headers["x-razorpay-signature"], "rzp"
    )
    verify(RAZORPAY, headers, body, ["rzp"])
    event = RAZORPAY.parse(headers, body)
    assert event.kind == kind
    if kind:
        assert (event.gateway_order_id, event.amount_minor, event.currency) == (
            "order-gw-1",
            50000,
            "INR",
        )


def test_razorpay_events_are_keyed_by_what_their_signed_body_says() -> None:
    """The id header is not signed: a signed body sent again under a new id
    is the same event."""
    body, headers = RAZORPAY.sample_request([sample("refund.processed")], "rzp", NOW)
    one = RAZORPAY.parse(headers, body)
    two = RAZORPAY.parse(headers | {"x-razorpay-event-id": "forged"}, body)
    assert one.event_id == two.event_id == "refund.processed:rfnd_evt_4f1c2b9a7d"


@pytest.mark.parametrize(
    ("name", "kind", "order", "amount"),
    [
        ("payment.captured.json", "succeeded", None, None),
        ("payment.failed.json", "failed", None, None),
        ("refund.processed.json", "refunded", "order_FPoIeimWki9j8A", 50000),
        ("payment.dispute.created.json", "disputed", None, None),
    ],
)
def test_razorpays_sample_events_map(
    name: str, kind: str, order: str | None, amount: int | None
) -> None:
    event = RAZORPAY.parse({}, fixture("razorpay", name))
    assert event.kind == kind and event.occurred_at is not None
    if order:
        assert (event.gateway_order_id, event.amount_minor) == (order, amount)


# -- Paddle ----------------------------------------------------------------------------

PADDLE = get_gateway("paddle")


def paddle_request(body: bytes, signature: str) -> Any:
    return SimpleNamespace(body=body, headers={"Paddle-Signature": signature})


@pytest.mark.parametrize("vector", vectors("paddle"), ids=lambda v: v["source"][-40:])
def test_paddles_published_vectors(vector: dict[str, Any]) -> None:
    body = vector["body"].encode()
    headers = {"paddle-signature": vector["header"]}
    if vector["valid"]:
        verify(PADDLE, headers, body, vector["secrets"])
    else:
        with pytest.raises(SignatureMismatch):
            verify(PADDLE, headers, body, vector["secrets"])
    # Signed in 2024: stale now.
    with pytest.raises(TimestampOutOfTolerance):
        verify(PADDLE, headers, body, vector["secrets"], now=time.time())


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [
        ("transaction.completed", "succeeded"),
        ("transaction.payment_failed", "failed"),
        ("adjustment.updated", "refunded"),
        ("adjustment.updated:chargeback", "disputed"),
    ],
)
def test_what_payhook_send_signs_paddles_library_verifies(event_type: str, kind: str) -> None:
    secret = PADDLE.generate_secret()
    body, headers = PADDLE.sample_request([sample(event_type)], secret, int(time.time()))
    request = paddle_request(body, headers["paddle-signature"])
    assert Verifier().verify(request, Secret(secret))
    verify(PADDLE, headers, body, [secret], now=time.time())
    event = PADDLE.parse({}, body)
    assert (event.kind, event.gateway_order_id, event.amount_minor) == (kind, "order-gw-1", 1999)
    assert event.merchant_reference == "ref-1"


def test_paddle_rotation_and_freshness() -> None:
    old, new = PADDLE.generate_secret(), PADDLE.generate_secret()
    body, headers = PADDLE.sample_request([sample("transaction.completed")], new, NOW)
    both = headers["paddle-signature"] + ";h1=" + "0" * 64
    verify(PADDLE, {"paddle-signature": both}, body, [old, new], now=NOW)
    with pytest.raises(TimestampOutOfTolerance):
        verify(PADDLE, headers, body, [new], now=NOW + 301)
    for bad in ("", "ts=abc;h1=00", "h1=00", "ts=1", "garbage"):
        with pytest.raises(MalformedHeaders):
            verify(PADDLE, {"paddle-signature": bad}, body, [new], now=NOW)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("transaction.completed.json", "succeeded"),
        ("transaction.payment_failed.json", "failed"),
        ("adjustment.updated.json", "refunded"),
        ("adjustment.created.json", None),
    ],
)
def test_paddles_sample_events_map(name: str, kind: str | None) -> None:
    event = PADDLE.parse({}, fixture("paddle", name))
    assert event.kind == kind
    if kind == "refunded":
        assert (event.gateway_order_id, event.amount_minor, event.currency) == (
            "txn_01h8bxpvx398a7zbawb77y0kp5",
            100,
            "USD",
        )
