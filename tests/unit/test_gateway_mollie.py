"""Mollie: signed webhook events checked against Mollie's signature validator;
every webhook, signed or classic, applied as what the API says of its payment."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mollie.utils.webhooks import InvalidSignatureException, SignatureValidator

from payhook.errors import GatewayUnavailable, MalformedHeaders, SignatureMismatch
from payhook.gateways.base import NO_CONFIG, Config, Sample
from payhook.gateways.mollie import MollieGateway, payment_events
from tests.gateway_api import FakeApi

FIXTURES = Path(__file__).parents[1] / "fixtures" / "mollie"
VECTORS = json.loads((FIXTURES / "vectors.json").read_text())
GATEWAY = MollieGateway()
CLASSIC = Config({"classic_webhooks": "true"}, {"api_key": "test_key"})


def verify(
    body: bytes, headers: dict[str, str], secrets: list[str], config: Config = NO_CONFIG
) -> None:
    GATEWAY.verify(headers, body, secrets, now=None, tolerance=None, config=config)


@pytest.mark.parametrize("vector", VECTORS)
def test_mollies_vectors_agree_with_its_validator(vector: dict[str, Any]) -> None:
    body = vector["body"].encode()
    header = {"x-mollie-signature": ", ".join(vector["signatures"])} if vector["signatures"] else {}
    validator = SignatureValidator(vector["secrets"])
    if vector["valid"] is None:  # no signature: a classic webhook, not verified here
        assert validator.validate_payload(vector["body"], vector["signatures"]) is False
        with pytest.raises(MalformedHeaders):
            verify(body, header, vector["secrets"])
    elif vector["valid"]:
        assert validator.validate_payload(vector["body"], vector["signatures"])
        verify(body, header, vector["secrets"])
    else:
        with pytest.raises(InvalidSignatureException):
            validator.validate_payload(vector["body"], vector["signatures"])
        with pytest.raises(SignatureMismatch):
            verify(body, header, vector["secrets"])


@pytest.mark.parametrize("event_type", ["payment.paid", "payment.failed", "refund.refunded"])
def test_what_payhook_send_signs_mollies_validator_accepts(event_type: str) -> None:
    sample = Sample("whe_abc123", event_type, "tr_WDqYK6vllg", 1000, "EUR", None, 1767225600)
    body, headers = GATEWAY.sample_request([sample], "whsec_mollie", 0)
    assert SignatureValidator("whsec_mollie").validate_payload(
        body.decode(), headers["x-mollie-signature"]
    )
    verify(body, headers, ["whsec_mollie"])
    trigger = GATEWAY.parse(headers, body)
    assert trigger.links_to == "tr_WDqYK6vllg" and trigger.kind is None


def test_a_classic_webhook_is_accepted_only_where_the_endpoint_allows_it() -> None:
    body = (FIXTURES / "classic_webhook_body.txt").read_bytes().strip()
    with pytest.raises(MalformedHeaders):
        verify(body, {}, ["s"], Config({}, {"api_key": "k"}))
    verify(body, {}, ["s"], CLASSIC)
    for bad in (b"id=tr_x&id=tr_y", b"id=re_123", b"id=tr_1&other=2", b"", b"id=tr_%00"):
        with pytest.raises(MalformedHeaders):
            verify(bad, {}, ["s"], CLASSIC)
    trigger = GATEWAY.parse({}, body)
    assert trigger.links_to == "tr_5B8cwPMGnU6qLbRvo7qEZo"


def payment(**fields: Any) -> dict[str, Any]:
    """Mollie's sample payment (open), without what was refunded or charged back."""
    base = json.loads((FIXTURES / "payment_single.json").read_text())
    base = {k: v for k, v in base.items() if k not in ("amountRefunded", "amountChargedBack")}
    return base | fields


def facts(data: dict[str, Any]) -> list[tuple[str, str | None, int | None]]:
    return [(e.event_id, e.kind, e.amount_minor) for e in payment_events(data["id"], data)]


def test_a_payment_says_what_happened_to_it_each_fact_keyed_by_itself() -> None:
    single = payment()
    tr = single["id"]
    assert facts(single) == [(f"{tr}:open", None, 1000)]
    canceled = json.loads((FIXTURES / "payment_canceled.json").read_text())
    assert facts(canceled) == [(f"{canceled['id']}:canceled", "failed", 1000)]
    paid = payment(status="paid", paidAt="2026-12-01T10:00:00+00:00")
    assert facts(paid) == [(f"{tr}:paid", "succeeded", 1000)]
    refunded = paid | {"amountRefunded": {"value": "2.50", "currency": "EUR"}}
    assert facts(refunded) == [
        (f"{tr}:paid", "succeeded", 1000),
        (f"{tr}:refunded:250", "refunded", 250),
    ]
    assert payment_events(tr, refunded)[1].cumulative
    charged = refunded | {"amountChargedBack": {"value": "7.50", "currency": "EUR"}}
    assert facts(charged)[-1] == (f"{tr}:chargeback:750", "disputed", 750)
    # Asked again, the same facts: a second webhook is a set of duplicates.
    assert payment_events(tr, charged) == payment_events(tr, charged)


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi("test_key", wrap=False, prefix="/v2")
    with fake.running():
        yield fake


def test_a_webhook_is_completed_from_the_api_or_retried(api: FakeApi) -> None:
    config = Config({"api_base_url": api.url, "classic_webhooks": "true"}, {"api_key": "test_key"})
    trigger = GATEWAY.parse({}, b"id=tr_7UhSN1zuXS")
    with pytest.raises(GatewayUnavailable, match="404"):
        GATEWAY.complete(trigger, config, 5)
    api.add("payments", json.loads((FIXTURES / "payment_canceled.json").read_text()))
    (event,) = GATEWAY.complete(trigger, config, 5)
    assert (event.kind, event.gateway_order_id, event.merchant_reference) == (
        "failed",
        "tr_7UhSN1zuXS",
        "12345",
    )
    assert api.requests[-1][1] == "/v2/payments/tr_7UhSN1zuXS"
    assert api.requests[-1][2]["authorization"] == "Bearer test_key"
    # An API that answers another payment than the one asked for is not believed.
    api.resources["payments"]["tr_7UhSN1zuXS"] = {**api.resources["payments"]["tr_7UhSN1zuXS"],
                                                  "id": "tr_other"}  # fmt: skip
    with pytest.raises(GatewayUnavailable, match="not that payment"):
        GATEWAY.complete(trigger, config, 5)
    with pytest.raises(GatewayUnavailable, match="401"):
        GATEWAY.complete(trigger, Config({"api_base_url": api.url}, {"api_key": "other"}), 5)
