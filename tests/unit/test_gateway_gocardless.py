"""GoCardless: the whole request verified, each event's resource read from the API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gocardless_pro import webhooks
from gocardless_pro.errors import InvalidSignatureError

from payhook.errors import GatewayUnavailable, MalformedEvent, MalformedHeaders, SignatureMismatch
from payhook.gateways.base import Config, Sample
from payhook.gateways.gocardless import GoCardlessGateway, sign
from tests.gateway_api import FakeApi

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gocardless"
VECTORS = json.loads((FIXTURES / "vectors.json").read_text())
GATEWAY = GoCardlessGateway()
SECRET = "ElfJ-3tF9I_zutNVK2lBABQrw0xNkPqe-M4O9F1V"
TOKEN = "read_only_token"


def verify(body: bytes, secrets: list[str], signature: str | None) -> None:
    headers = {} if signature is None else {"webhook-signature": signature}
    GATEWAY.verify(headers, body, secrets, now=None, tolerance=None)


@pytest.mark.parametrize("vector", VECTORS)
def test_gocardless_published_vectors_verify(vector: dict[str, Any]) -> None:
    body = vector["body"].encode()
    verify(body, [vector["secret"]], vector["signature"])
    with pytest.raises(SignatureMismatch):
        verify(body + b" ", [vector["secret"]], vector["signature"])
    assert webhooks.parse(body, vector["secret"], vector["signature"])


def test_what_payhook_signs_gocardless_library_parses_and_the_reverse() -> None:
    samples = [
        Sample("EV1", "payments.confirmed", "PM1", 1000, "EUR", None, 1767225600),
        Sample("EV2", "refunds.refund_settled", "PM1", 150, "EUR", None, 1767225600),
    ]
    body, headers = GATEWAY.sample_request(samples, SECRET, 0)
    events = webhooks.parse(body, SECRET, headers["webhook-signature"])
    assert [(e.id, e.action, e.resource_type) for e in events] == [
        ("EV1", "confirmed", "payments"),
        ("EV2", "refund_settled", "refunds"),
    ]
    own = (FIXTURES / "webhook_payments_refunds.json").read_bytes()
    verify(own, [SECRET], sign(SECRET, own))
    with pytest.raises(InvalidSignatureError):
        webhooks.parse(own, SECRET, sign("another", own))


def test_a_missing_or_wrong_signature_is_refused_as_gocardless_asks() -> None:
    body = (FIXTURES / "webhook_payments_refunds.json").read_bytes()
    with pytest.raises(MalformedHeaders):
        verify(body, [SECRET], None)
    with pytest.raises(SignatureMismatch):
        verify(body, [SECRET], sign(SECRET, body).upper())
    with pytest.raises(SignatureMismatch):
        verify(body, [SECRET], "é" * 64)
    verify(body, ["old", SECRET], sign(SECRET, body))  # during a rotation
    assert GATEWAY.refused_status == 498
    assert GATEWAY.accepted(["a"]).status == 204


def events() -> list[bytes]:
    parts = GATEWAY.split((FIXTURES / "webhook_payments_refunds.json").read_bytes())
    assert parts is not None
    return parts


def test_a_webhook_splits_into_its_events_which_link_to_their_objects() -> None:
    parsed = [GATEWAY.parse({}, part) for part in events()]
    assert [(e.event_id, e.event_type, e.kind, e.links_to) for e in parsed] == [
        ("EV123", "payments.confirmed", "succeeded", "PM123"),
        ("EV124", "payments.paid_out", "succeeded", "PM123"),
        ("EV125", "payments.failed", "failed", "PM124"),
        ("EV126", "payments.charged_back", "disputed", "PM125"),
        ("EV127", "refunds.refund_settled", "refunded", "RF123"),
    ]
    assert all(e.amount_minor is None and e.occurred_at is not None for e in parsed)
    sdk_events = [GATEWAY.parse({}, p) for p in GATEWAY.split(VECTORS[0]["body"].encode()) or []]
    # Subscriptions' and mandates' events: recorded, ignored.
    assert sdk_events and all(e.kind is None for e in sdk_events)


@pytest.mark.parametrize("body", [b"{}", b'{"events": []}', b'{"events": {}}', b"[]"])
def test_a_request_without_events_cannot_be_split(body: bytes) -> None:
    with pytest.raises(MalformedEvent):
        GATEWAY.split(body)


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi(TOKEN)
    fake.add("payments", json.loads((FIXTURES / "payment.json").read_text())["payments"])
    fake.add("refunds", json.loads((FIXTURES / "refund.json").read_text())["refunds"])
    with fake.running():
        yield fake


def config(api: FakeApi, token: str = TOKEN) -> Config:
    return Config({"api_base_url": api.url}, {"access_token": token})


def test_an_event_is_completed_with_its_objects_amount_from_the_api(api: FakeApi) -> None:
    confirmed, *_, refund = (GATEWAY.parse({}, part) for part in events())
    (paid,) = GATEWAY.complete(confirmed, config(api), 5)
    assert (paid.gateway_order_id, paid.amount_minor, paid.currency) == ("PM123", 1000, "EUR")
    (refunded,) = GATEWAY.complete(refund, config(api), 5)
    assert (refunded.gateway_order_id, refunded.amount_minor) == ("PM123", 150)
    assert not refunded.cumulative and refunded.meaning != refund.meaning
    method, path, headers = api.requests[0]
    assert (method, path) == ("GET", "/payments/PM123")
    assert headers["authorization"] == f"Bearer {TOKEN}"
    assert headers["gocardless-version"] == "2015-07-06"


@pytest.mark.parametrize("status", [401, 404, 429, 500, 503])
def test_an_api_that_fails_leaves_the_event_unapplied_for_a_retry(
    api: FakeApi, status: int
) -> None:
    confirmed = GATEWAY.parse({}, events()[0])
    api.fail_next = [status]
    with pytest.raises(GatewayUnavailable, match=str(status)):
        GATEWAY.complete(confirmed, config(api), 5)
    assert GATEWAY.complete(confirmed, config(api), 5)[0].amount_minor == 1000


def test_an_api_that_does_not_answer_in_time_or_a_wrong_token_fail_too(api: FakeApi) -> None:
    confirmed = GATEWAY.parse({}, events()[0])
    api.delay = 1.0
    with pytest.raises(GatewayUnavailable, match="Timeout"):
        GATEWAY.complete(confirmed, config(api), 0.2)
    api.delay = 0
    with pytest.raises(GatewayUnavailable, match="401"):
        GATEWAY.complete(confirmed, config(api, "another"), 5)
    with pytest.raises(GatewayUnavailable, match="access_token"):
        GATEWAY.complete(confirmed, Config({"api_base_url": api.url}, {}), 5)


def test_an_api_answering_another_object_or_no_amount_is_malformed(api: FakeApi) -> None:
    confirmed = GATEWAY.parse({}, events()[0])
    api.resources["payments"]["PM123"] = {"id": "PM999", "amount": 1000, "currency": "EUR"}
    with pytest.raises(MalformedEvent, match=r"payments\.id"):
        GATEWAY.complete(confirmed, config(api), 5)
    api.add("payments", {"id": "PM123", "amount": "ten", "currency": "EUR"})
    with pytest.raises(MalformedEvent, match="amount"):
        GATEWAY.complete(confirmed, config(api), 5)


def test_the_settings_of_an_endpoint_are_checked() -> None:
    GATEWAY.check_config(Config({}, {"access_token": "t"}))
    GATEWAY.check_config(Config({"api_base_url": "http://127.0.0.1:9"}, {"access_token": "t"}))
    with pytest.raises(ValueError, match="required"):
        GATEWAY.check_config(Config({}, {}))
    with pytest.raises(ValueError, match="https"):
        GATEWAY.check_config(
            Config({"api_base_url": "http://api.gocardless.com"}, {"access_token": "t"})
        )
