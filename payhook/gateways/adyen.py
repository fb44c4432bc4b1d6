"""Adyen standard webhooks (notifications).

A request is `{"live": ..., "notificationItems": [{"NotificationRequestItem":
{...}}, ...]}`. Each item carries its own signature in
`additionalData.hmacSignature`: base64 of HMAC-SHA256, keyed with the
hex-decoded HMAC key of the endpoint, over the item's

    pspReference:originalReference:merchantAccountCode:merchantReference:value:currency:eventCode:success

with an absent field as the empty string and no escaping (Adyen's libraries
sign so; `Adyen.util.generate_notification_sig`). payhook verifies every item
of a request (Adyen's own Python helper checks only the first) and refuses
the whole request when one fails. Optionally the endpoint also requires the
basic-auth user name and password configured at Adyen.

Adyen's items have no event id: payhook keys each by
`{eventCode}:{pspReference}:{success}`, the fields Adyen treats as the
identity of a notification, so a redelivery is a duplicate and a later
notification of the same payment with another outcome is a new event.
Adyen expects a 2xx answer with the body `[accepted]`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hmac
import json
import secrets as random
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from payhook.errors import MalformedEvent, MalformedHeaders, SignatureMismatch
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    NO_CONFIG,
    Config,
    Event,
    GatewayBase,
    Reply,
    Sample,
    Setting,
    canonical_digest,
    check_settings,
    iso_time,
    load_json_object,
    meaning_digest,
    object_meaning,
    raw_digest,
    require_amount,
    require_currency,
    require_str,
    same_bytes,
)

#: Adyen's event codes payhook acts on, by the `success` they carry.
TYPES = {
    ("AUTHORISATION", "true"): "succeeded",
    ("AUTHORISATION", "false"): "failed",
    ("REFUND", "true"): "refunded",
    ("CHARGEBACK", "true"): "disputed",
    ("NOTIFICATION_OF_CHARGEBACK", "true"): "disputed",
}
#: The fields of an item its signature covers, in order.
SIGNED_FIELDS = (
    "pspReference",
    "originalReference",
    "merchantAccountCode",
    "merchantReference",
    "value",
    "currency",
    "eventCode",
    "success",
)
#: Event codes whose item names the payment in `originalReference`.
OF_A_PAYMENT = frozenset({"REFUND", "CHARGEBACK", "NOTIFICATION_OF_CHARGEBACK"})
ACCEPTED = Reply(200, b"[accepted]", b"text/plain")


def hmac_key(secret: str) -> bytes:
    """The key an Adyen HMAC key (hex, as the Customer Area shows it) names."""
    try:
        key = bytes.fromhex(secret)
    except ValueError:
        raise ValueError(
            "an Adyen HMAC key is hexadecimal, as the Customer Area shows it"
        ) from None
    if not key:
        raise ValueError("an Adyen HMAC key may not be empty")
    return key


def signing_string(item: Mapping[str, Any]) -> str:
    amount = item.get("amount")
    amount = amount if isinstance(amount, dict) else {}
    values = {**item, "value": amount.get("value"), "currency": amount.get("currency")}
    return ":".join(_text(values.get(name)) for name in SIGNED_FIELDS)


def sign(secret: str, item: Mapping[str, Any]) -> str:
    """An item's `hmacSignature` under the HMAC key `secret`."""
    digest = hmac.digest(hmac_key(secret), signing_string(item).encode(), "sha256")
    return base64.b64encode(digest).decode()


def _text(value: object) -> str:
    """A signed field as Adyen renders it: absent is empty, JSON's true is `true`."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _items(body: bytes) -> list[dict[str, Any]]:
    """The `NotificationRequestItem`s of a request; `MalformedEvent` if it has none."""
    data = load_json_object(body)
    items = data.get("notificationItems")
    if not isinstance(items, list) or not items:
        raise MalformedEvent("notificationItems", "expected a non-empty list")
    found = []
    for entry in items:
        item = entry.get("NotificationRequestItem") if isinstance(entry, dict) else None
        if not isinstance(item, dict):
            raise MalformedEvent("notificationItems", "expected NotificationRequestItem objects")
        found.append(item)
    return found


class AdyenGateway(GatewayBase):
    name = "adyen"
    #: The signatures are in the body; the header is the optional basic auth.
    signature_headers: tuple[str, ...] = ("authorization",)
    settings: Mapping[str, Setting] = MappingProxyType(
        {
            "basic_auth_user": Setting("the user name configured for the webhook at Adyen"),
            "basic_auth_password": Setting(
                "the password configured for the webhook at Adyen", credential=True, verifies=True
            ),
        }
    )
    #: Adyen signs no timestamp: nothing to hold a request's age against.
    tolerance: float | None = None
    #: Adyen retries a notification it could not deliver for up to 30 days.
    redelivery_window: float = 30 * DAY
    sample_type = "AUTHORISATION"

    def generate_secret(self) -> str:
        """Adyen generates the HMAC key in its Customer Area; one made here
        is for tests and `payhook send`."""
        return random.token_hex(32).upper()

    def check_secret(self, secret: str) -> None:
        hmac_key(secret)

    def check_config(self, config: Config) -> None:
        check_settings(self.settings, config)
        if bool(config.settings.get("basic_auth_user")) != bool(
            config.credentials.get("basic_auth_password")
        ):
            raise ValueError("basic_auth_user and basic_auth_password go together")

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return None  # one request carries several: the log line counts them

    def new_event_id(self) -> str:
        """A PSP reference, as Adyen makes them: 16 characters."""
        return random.token_hex(8).upper()

    def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        secrets: Sequence[str],
        *,
        now: float | None,
        tolerance: float | None,
        config: Config = NO_CONFIG,
    ) -> None:
        _check_basic_auth(headers, config)
        try:
            items = _items(body)
        except MalformedEvent:
            raise SignatureMismatch() from None  # nothing in it is signed
        keys = _keys(secrets)
        for item in items:
            additional = item.get("additionalData")
            given = additional.get("hmacSignature") if isinstance(additional, dict) else None
            if not isinstance(given, str):
                raise SignatureMismatch()
            content = signing_string(item).encode()
            found = False
            for key in keys:
                expected = base64.b64encode(hmac.digest(key, content, "sha256"))
                found |= hmac.compare_digest(expected, given.encode("utf-8", "replace"))
            if not found:
                raise SignatureMismatch()

    def split(self, body: bytes) -> list[bytes] | None:
        return [
            json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode(
                "utf-8", "surrogatepass"
            )
            for item in _items(body)
        ]

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        """One item, as `split` made it."""
        item = load_json_object(body)
        code = require_str(item, "eventCode")
        psp = require_str(item, "pspReference")
        success = item.get("success")
        success = _text(success) if isinstance(success, str | bool) else None
        if success not in ("true", "false"):
            raise MalformedEvent("success", 'expected "true" or "false"')
        assert code is not None and psp is not None
        event_id = f"{code}:{psp}:{success}"
        event_type = code if success == "true" else f"{code}:false"
        digest = canonical_digest(_without_signature(item))
        occurred_at = iso_time(item.get("eventDate"))
        kind = TYPES.get((code, success))
        if kind is None:
            meaning = object_meaning(event_type, psp)
            return Event.ignored(event_id, event_type, occurred_at, digest, meaning=meaning)
        if occurred_at is None:
            raise MalformedEvent("eventDate", "expected an ISO 8601 time with its offset")
        amount = item.get("amount")
        if not isinstance(amount, dict):
            raise MalformedEvent("amount", "expected an object")
        order_id = require_str(item, "originalReference") if code in OF_A_PAYMENT else psp
        event = Event(
            event_id=event_id,
            event_type=event_type,
            kind=kind,
            occurred_at=occurred_at,
            gateway_order_id=order_id,
            # Adyen sends an empty reference for a payment made without one.
            merchant_reference=require_str(
                {"merchantReference": item.get("merchantReference") or None},
                "merchantReference",
                optional=True,
                limit=MAX_REFERENCE,
            ),
            amount_minor=require_amount(amount, "value"),
            currency=require_currency(amount, "currency"),
            digest=digest,
        )
        return dataclasses.replace(event, meaning=meaning_digest(event, success))

    def unreadable_digest(self, body: bytes) -> str:
        try:
            return canonical_digest(_without_signature(load_json_object(body)))
        except (MalformedEvent, RecursionError):
            return raw_digest(body)

    def accepted(self, delivery_ids: Sequence[str]) -> Reply:
        return ACCEPTED

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        """A notification of `samples`, one item each. A type is an event
        code, `AUTHORISATION:false` for a refused payment. Each item's PSP
        reference is its sample's event id, but an authorisation's: the
        payment's own (the gateway order id), which later items name."""
        items = []
        for sample in samples:
            code, _, success = sample.event_type.partition(":")
            item: dict[str, Any] = {
                "additionalData": {},
                "amount": {"currency": sample.currency.upper(), "value": sample.amount},
                "eventCode": code,
                "eventDate": _iso(sample.occurred_at),
                "merchantAccountCode": "PayhookTestMerchant",
                "merchantReference": sample.merchant_reference or "",
                "paymentMethod": "visa",
                "pspReference": sample.gateway_order_id
                if code == "AUTHORISATION"
                else sample.event_id,
                "success": success or "true",
            }
            if code in OF_A_PAYMENT:
                item["originalReference"] = sample.gateway_order_id
            item["additionalData"]["hmacSignature"] = sign(secret, item)
            items.append({"NotificationRequestItem": item})
        body = json.dumps({"live": "false", "notificationItems": items}).encode()
        headers = {}
        user = config.settings.get("basic_auth_user")
        if user:
            password = config.credentials.get("basic_auth_password", "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            headers["authorization"] = f"Basic {token}"
        return body, headers


def _keys(secrets: Sequence[str]) -> list[bytes]:
    """The HMAC keys of the secrets that are one (a row written by hand may hold others)."""
    keys = []
    for secret in secrets:
        try:
            keys.append(hmac_key(secret))
        except (TypeError, ValueError):
            continue
    return keys


def _check_basic_auth(headers: Mapping[str, str], config: Config) -> None:
    user = config.settings.get("basic_auth_user")
    if not user:
        return
    password = config.credentials.get("basic_auth_password")
    if not password:
        # Configured, but the password does not open: nothing can match.
        raise SignatureMismatch()
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not token:
        raise MalformedHeaders()
    try:
        given = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MalformedHeaders() from None
    expected = f"{user}:{password}".encode()
    if not same_bytes(expected, given):
        raise SignatureMismatch()


def _without_signature(item: dict[str, Any]) -> dict[str, Any]:
    """The item but its signature, which a new HMAC key would change."""
    additional = item.get("additionalData")
    if not isinstance(additional, dict) or "hmacSignature" not in additional:
        return item
    rest = {k: v for k, v in additional.items() if k != "hmacSignature"}
    return {**item, "additionalData": rest}


def _iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat()
