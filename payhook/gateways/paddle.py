"""Paddle Billing webhooks.

`Paddle-Signature: ts=<unix>;h1=<hex>[;h1=<hex>...]`, each `h1` an HMAC-SHA256
over `{ts}:{raw body}` keyed with the notification destination's secret key
(several while Paddle rotates it); `paddle_billing.Notifications.Verifier`
checks the same. payhook allows the timestamp 300 s either way (Paddle's
SDK, 5 s): a request signed once and delayed, or a skewed clock, is not
refused for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets as random
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from payhook.errors import MalformedEvent, MalformedHeaders
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    MAX_SIGNATURE_HEADER,
    NO_CONFIG,
    Config,
    Event,
    GatewayBase,
    Sample,
    canonical_digest,
    check_printable,
    check_tolerance,
    iso_time,
    json_text,
    load_json_object,
    meaning_digest,
    object_meaning,
    one_event,
    require_currency,
    require_signature,
    require_str,
)

HEADER = "paddle-signature"
TOLERANCE = 300
#: Adjustment actions payhook acts on, once approved.
ADJUSTMENTS = {"refund": "refunded", "chargeback": "disputed"}
#: Digits of a total in minor units, as Paddle writes them (a string).
MAX_DIGITS = 18


def sign(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}:".encode() + body, hashlib.sha256).hexdigest()


class PaddleGateway(GatewayBase):
    name = "paddle"
    signature_headers: tuple[str, ...] = (HEADER,)
    tolerance: float | None = TOLERANCE
    #: Paddle retries for 3 days.
    redelivery_window: float = 7 * DAY
    sample_type = "transaction.completed"

    def generate_secret(self) -> str:
        return "pdl_ntfset_" + random.token_hex(13) + "_" + random.token_urlsafe(24)

    def check_secret(self, secret: str) -> None:
        check_printable(secret, "a Paddle secret key")

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return json_text(body, "event_id")

    def new_event_id(self) -> str:
        return "evt_" + random.token_hex(13)

    def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        secrets: Sequence[str],
        *,
        now: float | None,
        tolerance: float | None = TOLERANCE,
        config: Config = NO_CONFIG,
    ) -> None:
        timestamp, given = _read_header(headers.get(HEADER, ""))
        check_tolerance(timestamp, now, tolerance)
        require_signature(given, secrets, lambda secret: sign(secret, timestamp, body))

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        data = load_json_object(body)
        event_id = require_str(data, "event_id")
        event_type = require_str(data, "event_type")
        assert event_id is not None and event_type is not None
        digest = canonical_digest(data)
        occurred_at = iso_time(data.get("occurred_at"))
        obj = data.get("data")
        obj = obj if isinstance(obj, dict) else {}
        kind, status = _kind(event_type, obj)
        if kind is None:
            meaning = object_meaning(event_type, obj.get("id"), status)
            return Event.ignored(event_id, event_type, occurred_at, digest, meaning=meaning)
        if occurred_at is None:
            raise MalformedEvent("occurred_at", "expected an ISO 8601 time")
        if event_type.startswith("transaction."):
            order_id = require_str(obj, "id")
            details = obj.get("details")
            totals = details.get("totals") if isinstance(details, dict) else None
            total, field = (totals or {}).get("grand_total"), "data.details.totals.grand_total"
        else:
            order_id = require_str(obj, "transaction_id")
            totals = obj.get("totals")
            total, field = (
                (totals or {}).get("total") if isinstance(totals, dict) else None,
                ("data.totals.total"),
            )
        custom = obj.get("custom_data")
        event = Event(
            event_id=event_id,
            event_type=event_type,
            kind=kind,
            occurred_at=occurred_at,
            gateway_order_id=order_id,
            merchant_reference=require_str(custom, "order_id", optional=True, limit=MAX_REFERENCE)
            if isinstance(custom, dict)
            else None,
            amount_minor=_minor_units(total, field),
            currency=require_currency(obj, "currency_code"),
            digest=digest,
        )
        return dataclasses.replace(event, meaning=meaning_digest(event, status))

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        """An event as Paddle posts it; `adjustment.updated` is an approved
        refund, `adjustment.updated:chargeback` an approved chargeback."""
        sample = one_event(samples)
        event_type, _, action = sample.event_type.partition(":")
        occurred = (
            datetime.fromtimestamp(sample.occurred_at, UTC).isoformat().replace("+00:00", "Z")
        )
        custom = {"order_id": sample.merchant_reference} if sample.merchant_reference else None
        currency = sample.currency.upper()
        obj: dict[str, Any]
        if event_type.startswith("adjustment."):
            obj = {
                "id": "adj_" + sample.event_id[4:],
                "action": action or "refund",
                "status": "approved",
                "transaction_id": sample.gateway_order_id,
                "currency_code": currency,
                "totals": {"total": str(sample.amount), "currency_code": currency},
                "custom_data": custom,
            }
        else:
            status = "completed" if event_type == "transaction.completed" else "past_due"
            obj = {
                "id": sample.gateway_order_id,
                "status": status,
                "currency_code": currency,
                "details": {"totals": {"grand_total": str(sample.amount)}},
                "custom_data": custom,
            }
        event = {
            "event_id": sample.event_id,
            "event_type": event_type,
            "occurred_at": occurred,
            "notification_id": "ntf_" + sample.event_id[4:],
            "data": obj,
        }
        body = json.dumps(event, separators=(",", ":")).encode()
        return body, {HEADER: f"ts={timestamp};h1={sign(secret, timestamp, body)}"}


def _kind(event_type: str, obj: Mapping[str, Any]) -> tuple[str | None, Any]:
    status = obj.get("status")
    if event_type == "transaction.completed":
        return "succeeded", status
    if event_type == "transaction.payment_failed":
        return "failed", status
    if event_type in ("adjustment.created", "adjustment.updated") and status == "approved":
        return ADJUSTMENTS.get(str(obj.get("action"))), status
    return None, status


def _minor_units(value: object, field: str) -> int:
    """A total as Paddle writes it: minor units, as a string of digits."""
    if (
        not isinstance(value, str)
        or not value.isascii()
        or not value.isdigit()
        or len(value) > MAX_DIGITS
    ):
        raise MalformedEvent(field, "expected minor units as a string of digits")
    return int(value)


def _read_header(header: str) -> tuple[int, list[bytes]]:
    if not header or len(header) > MAX_SIGNATURE_HEADER:
        raise MalformedHeaders()
    timestamp: int | None = None
    signatures: list[bytes] = []
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if not sep:
            raise MalformedHeaders()
        if key == "ts":
            if not value.isascii() or not value.isdigit() or len(value) > 12:
                raise MalformedHeaders()
            timestamp = int(value)
        elif key == "h1":
            signatures.append(value.encode("latin-1", "replace"))
    if timestamp is None or not signatures:
        raise MalformedHeaders()
    return timestamp, signatures
