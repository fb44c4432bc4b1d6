"""Adyen: every item verified, against Adyen's own library and its published vectors."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from Adyen import util as adyen_util

from payhook.errors import MalformedEvent, MalformedHeaders, SignatureMismatch
from payhook.gateways import get_gateway
from payhook.gateways.adyen import AdyenGateway, sign, signing_string
from payhook.gateways.base import Config, Sample

FIXTURES = Path(__file__).parents[1] / "fixtures" / "adyen"
VECTORS = json.loads((FIXTURES / "vectors.json").read_text())
KEY = VECTORS[0]["key"]
GATEWAY = AdyenGateway()


def request(*items: dict[str, Any]) -> bytes:
    return json.dumps(
        {"live": "false", "notificationItems": [{"NotificationRequestItem": i} for i in items]}
    ).encode()


def signed(item: dict[str, Any], key: str = KEY) -> dict[str, Any]:
    item = json.loads(json.dumps(item))
    item.setdefault("additionalData", {})["hmacSignature"] = sign(key, item)
    return item


def verify(
    body: bytes, secrets: list[str], headers: dict[str, str] | None = None, **config: Any
) -> None:
    GATEWAY.verify(headers or {}, body, secrets, now=None, tolerance=None, config=Config(**config))


@pytest.mark.parametrize("vector", VECTORS, ids=[v["source"].split()[1][:60] for v in VECTORS])
def test_adyens_published_vectors_verify(vector: dict[str, Any]) -> None:
    item = json.loads(json.dumps(vector["item"]))
    item.setdefault("additionalData", {})["hmacSignature"] = vector["signature"]
    verify(request(item), [vector["key"]])
    assert sign(vector["key"], vector["item"]) == vector["signature"]


def test_what_adyens_library_signs_payhook_accepts_and_the_reverse() -> None:
    sample = Sample("PSP1", "AUTHORISATION", "8835511210681752", 4200, "EUR", "order-7", 1767225600)
    refund = Sample("PSP2", "REFUND", "8835511210681752", 1200, "EUR", "order-7", 1767225600)
    body, headers = GATEWAY.sample_request([sample, refund], KEY, 0)
    for entry in json.loads(body)["notificationItems"]:
        item = entry["NotificationRequestItem"]
        assert adyen_util.is_valid_hmac_notification(item, KEY)
        library = dict(item, additionalData={})
        library["additionalData"]["hmacSignature"] = adyen_util.generate_notification_sig(
            library, KEY
        ).decode()
        verify(request(library), [KEY])
    verify(body, [KEY], headers)


def test_every_item_of_a_batch_is_verified_not_only_the_first() -> None:
    vector = VECTORS[0]["item"]
    good = signed(vector)
    forged = dict(signed(vector), pspReference="9999999999999999")  # signature of another item
    body = json.loads(request(good, forged))
    # Adyen's helper, given the request, checks the first item alone:
    assert adyen_util.is_valid_hmac_notification(body, KEY)
    with pytest.raises(SignatureMismatch):
        verify(request(good, forged), [KEY])
    with pytest.raises(SignatureMismatch):
        verify(request(good, dict(vector, additionalData={})), [KEY])


def test_any_active_key_verifies_during_a_rotation_and_no_other() -> None:
    other = GATEWAY.generate_secret()
    body = request(signed(VECTORS[0]["item"], other))
    verify(body, ["not hex", KEY, other])
    with pytest.raises(SignatureMismatch):
        verify(body, [KEY])


@pytest.mark.parametrize("body", [b"", b"[]", b'{"notificationItems": []}', b"\xff"])
def test_a_body_with_nothing_signed_is_refused(body: bytes) -> None:
    with pytest.raises(SignatureMismatch):
        verify(body, [KEY])


def test_the_signing_string_renders_absent_fields_empty_and_json_booleans_as_adyen_does() -> None:
    assert signing_string({"eventCode": "REPORT_AVAILABLE", "success": True}) == (
        "::::::REPORT_AVAILABLE:true"
    )


BASIC = {"basic_auth_user": "adyen"}


def basic(user: str, password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_basic_auth_when_configured_is_required_and_checked() -> None:
    body = request(signed(VECTORS[0]["item"]))
    credentials = {"basic_auth_password": "s3cret"}
    verify(body, [KEY], basic("adyen", "s3cret"), settings=BASIC, credentials=credentials)
    with pytest.raises(SignatureMismatch):
        verify(body, [KEY], basic("adyen", "wrong"), settings=BASIC, credentials=credentials)
    with pytest.raises(MalformedHeaders):
        verify(body, [KEY], {}, settings=BASIC, credentials=credentials)
    # A password that did not open (a wrong key) admits nobody.
    with pytest.raises(SignatureMismatch):
        verify(body, [KEY], basic("adyen", ""), settings=BASIC, credentials={})


def test_the_settings_of_an_endpoint_are_checked() -> None:
    GATEWAY.check_config(Config(BASIC, {"basic_auth_password": "x"}))
    with pytest.raises(ValueError, match="go together"):
        GATEWAY.check_config(Config(BASIC, {}))
    with pytest.raises(ValueError, match="credential"):
        GATEWAY.check_config(Config({"basic_auth_password": "x"}, {}))
    with pytest.raises(ValueError, match="unknown setting"):
        GATEWAY.check_config(Config({"webhook_url": "x"}, {}))


def parts(path: str) -> list[bytes]:
    split = GATEWAY.split((FIXTURES / path).read_bytes())
    assert split is not None
    return split


@pytest.mark.parametrize(
    ("path", "kind", "event_type", "order"),
    [
        (
            "authorisation_success_true.openapi.json",
            "succeeded",
            "AUTHORISATION",
            "QFQTPCQ8HXSKGK82",
        ),
        ("authorisation_success_true.java-sdk.json", "succeeded", "AUTHORISATION", None),
        ("refund_success_true.java-sdk.json", "refunded", "REFUND", None),
        ("refund_success_false.java-sdk.json", None, "REFUND:false", None),
        ("refund_success_false.openapi.json", None, "REFUND:false", None),
        ("chargeback.java-sdk.json", "disputed", "CHARGEBACK", "9913333333333333"),
        ("notification_of_chargeback.openapi.json", "disputed", "NOTIFICATION_OF_CHARGEBACK", None),
    ],
)
def test_adyens_sample_notifications_map(
    path: str, kind: str | None, event_type: str, order: str | None
) -> None:
    (part,) = parts(path)
    event = GATEWAY.parse({}, part)
    item = json.loads(part)
    assert event.kind == kind and event.event_type == event_type
    assert event.event_id == f"{item['eventCode']}:{item['pspReference']}:{item['success']}"
    if kind is not None:
        assert event.amount_minor == item["amount"]["value"]
        assert event.currency == item["amount"]["currency"]
        assert event.merchant_reference == (item["merchantReference"] or None)
        expected = item.get("originalReference") if kind != "succeeded" else item["pspReference"]
        assert event.gateway_order_id == (order or expected)
        assert event.occurred_at is not None


def test_derived_ids_make_retries_duplicates_and_distinct_notifications_distinct() -> None:
    item = signed(VECTORS[0]["item"])
    (first,) = GATEWAY.split(request(item)) or []
    # A retry: re-rendered, its signature made with a new key; same meaning.
    (again,) = GATEWAY.split(request(signed(dict(reversed(item.items())), "AB" * 32))) or []
    refused = dict(item, success="false")
    (other,) = GATEWAY.split(request(signed(refused))) or []
    one, two, three = (GATEWAY.parse({}, p) for p in (first, again, other))
    assert one.event_id == two.event_id and one.digest == two.digest and one.meaning == two.meaning
    assert three.event_id != one.event_id and three.kind == "failed"
    (part,) = GATEWAY.split(request(dict(item, amount={"value": 1, "currency": "EUR"}))) or []
    changed = GATEWAY.parse({}, part)
    assert changed.event_id == one.event_id and changed.meaning != one.meaning


def test_an_item_payhook_cannot_map_is_malformed_naming_the_field() -> None:
    item = dict(VECTORS[0]["item"], eventDate="yesterday")
    with pytest.raises(MalformedEvent) as raised:
        GATEWAY.parse({}, json.dumps(item).encode())
    assert raised.value.field == "eventDate"
    with pytest.raises(MalformedEvent) as raised:
        GATEWAY.parse({}, json.dumps(dict(item, success="maybe")).encode())
    assert raised.value.field == "success"


def test_adyen_is_answered_accepted_and_registered() -> None:
    assert isinstance(get_gateway("adyen"), AdyenGateway)
    reply = GATEWAY.accepted(["a", "b"])
    assert 200 <= reply.status < 300 and reply.body == b"[accepted]"
