"""Braintree: the form's signature on the request path, the XML in the consumer."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

import braintree
import pytest
from braintree.exceptions.invalid_signature_error import InvalidSignatureError

from payhook.errors import MalformedEvent, MalformedHeaders, SignatureMismatch
from payhook.gateways.base import Sample
from payhook.gateways.braintree import BraintreeGateway, sign

FIXTURES = Path(__file__).parents[1] / "fixtures" / "braintree"
GATEWAY = BraintreeGateway()
PUBLIC, PRIVATE = "test_public_key", "test_private_key"
SECRET = f"{PUBLIC}:{PRIVATE}"


def library(public: str = PUBLIC, private: str = PRIVATE) -> braintree.BraintreeGateway:
    return braintree.BraintreeGateway(
        braintree.Configuration(
            environment=braintree.Environment.Sandbox,
            merchant_id="payhook_merchant",
            public_key=public,
            private_key=private,
        )
    )


def form(signature: str, payload: str | bytes) -> bytes:
    text = payload.decode() if isinstance(payload, bytes) else payload
    return urlencode({"bt_signature": signature, "bt_payload": text}).encode()


def verify(body: bytes, secrets: list[str]) -> None:
    GATEWAY.verify({}, body, secrets, now=None, tolerance=None)


FILES = sorted(p.name for p in FIXTURES.glob("*.json"))


@pytest.mark.parametrize("name", FILES)
def test_notifications_braintrees_library_made_verify_and_read(name: str) -> None:
    fixture = json.loads((FIXTURES / name).read_text())
    body = form(fixture["bt_signature"], fixture["bt_payload"])
    verify(body, ["other:key", SECRET])
    with pytest.raises(SignatureMismatch):
        verify(body, [f"{PUBLIC}:another_private_key"])
    event = GATEWAY.parse({}, body)
    assert event.event_id.startswith(f"{fixture['kind']}:") and event.event_id.endswith(
        f":{fixture['id']}"
    )


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("transaction_settled", "succeeded"),
        ("transaction_settlement_declined", "failed"),
        ("dispute_opened", "disputed"),
        ("dispute_won", None),
        ("dispute_lost", None),
        ("subscription_charged_successfully", None),
    ],
)
def test_what_the_library_signs_now_payhook_accepts_and_maps(
    kind: str, expected: str | None
) -> None:
    sample = library().webhook_testing.sample_notification(kind, "subject_1")
    body = form(sample["bt_signature"], sample["bt_payload"])
    verify(body, [SECRET])
    event = GATEWAY.parse({}, body)
    assert event.kind == expected and event.event_type == kind
    if expected is not None:
        assert (event.amount_minor, event.currency) == (10000, "USD")
        assert event.gateway_order_id == "subject_1"


@pytest.mark.parametrize(
    "event_type",
    [
        "transaction_settled",
        "transaction_settlement_declined",
        "dispute_opened",
        "transaction_settled:credit",
    ],
)
def test_what_payhook_send_signs_braintrees_library_parses(event_type: str) -> None:
    sample = Sample("ev1", event_type, "txn_42", 1999, "EUR", "order-42", 1767225600)
    body, headers = GATEWAY.sample_request([sample], SECRET, 0)
    assert headers["content-type"] == "application/x-www-form-urlencoded"
    fields = {k: v[0] for k, v in parse_qs(body.decode()).items()}
    notification = library().webhook_notification.parse(
        fields["bt_signature"], fields["bt_payload"]
    )
    assert notification.kind == event_type.split(":")[0]
    with pytest.raises(InvalidSignatureError):
        library(private="another").webhook_notification.parse(
            fields["bt_signature"], fields["bt_payload"]
        )
    event = GATEWAY.parse({}, body)
    assert (event.amount_minor, event.currency, event.merchant_reference) == (
        1999,
        "EUR",
        "order-42",
    )
    assert event.gateway_order_id == "txn_42"
    if event_type.endswith(":credit"):
        assert event.kind == "refunded"


def test_the_payload_is_signed_as_sent_with_or_without_its_last_newline() -> None:
    sample = library().webhook_testing.sample_notification("transaction_settled", "t1")
    payload = sample["bt_payload"]
    payload = payload.decode() if isinstance(payload, bytes) else payload
    verify(form(sample["bt_signature"], payload.rstrip("\n")), [SECRET])
    with pytest.raises(SignatureMismatch):
        verify(form(sample["bt_signature"], payload.replace("\n", "")), [SECRET])
    with pytest.raises(SignatureMismatch):
        verify(form(sample["bt_signature"], payload.replace("\n", "\r\n")), [SECRET])
    # Several pairs, one per key pair: the one of the endpoint's public key counts.
    pairs = f"other_public|{'0' * 40}&{sample['bt_signature']}"
    verify(form(pairs, payload), [SECRET])
    wrong_key = re.sub(r"^[^|]+", "another_public", sample["bt_signature"])
    with pytest.raises(SignatureMismatch):
        verify(form(wrong_key, payload), [SECRET])


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"bt_signature=x",
        b"bt_payload=eA==",
        b"\xff",
        b"bt_signature=a&bt_signature=b&bt_payload=c",
    ],
)
def test_a_body_that_is_not_one_notification_is_refused(body: bytes) -> None:
    with pytest.raises(MalformedHeaders):
        verify(body, [SECRET])


def test_a_secret_is_the_key_pair() -> None:
    GATEWAY.check_secret(SECRET)
    for bad in ("no_colon", ":private", "public:", "pub|lic:private"):
        with pytest.raises(ValueError, match="PUBLIC_KEY:PRIVATE_KEY"):
            GATEWAY.check_secret(bad)


def parsed(xml: str) -> Any:
    payload = base64.encodebytes(xml.encode())
    return GATEWAY.parse({}, form(sign(SECRET, payload), payload))


def test_an_unreadable_notification_is_malformed_naming_what() -> None:
    with pytest.raises(MalformedEvent, match="bt_payload"):
        parsed("<notification><kind>transaction_settled</kind>")
    with pytest.raises(MalformedEvent, match="amount"):
        parsed(
            '<notification><timestamp type="datetime">2026-12-01T10:00:00Z</timestamp>'
            "<kind>transaction_settled</kind><subject><transaction><id>t</id>"
            "<amount>10.005</amount><currency-iso-code>EUR</currency-iso-code>"
            "</transaction></subject></notification>"
        )
