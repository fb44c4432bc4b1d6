"""Square webhooks.

`x-square-hmacsha256-signature` is base64 HMAC-SHA256, keyed with the
subscription's signature key, over the notification URL exactly as it is
configured at Square followed by the raw body (Square's SDK,
`square.utils.webhooks_helper.verify_signature`, checks the same). The URL
is the endpoint's `notification_url` setting: behind a proxy that rewrites
it, the ingress cannot know it.
"""

from __future__ import annotations

import base64
import dataclasses
import hmac
import json
import secrets as random
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from payhook.errors import MalformedEvent, SignatureMismatch
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    NO_CONFIG,
    Config,
    Event,
    GatewayBase,
    Sample,
    Setting,
    canonical_digest,
    check_printable,
    check_settings,
    iso_time,
    json_text,
    load_json_object,
    meaning_digest,
    object_meaning,
    one_event,
    require_amount,
    require_currency,
    require_signature,
    require_str,
    signature_header,
)

HEADER = "x-square-hmacsha256-signature"


def sign(secret: str, url: str, body: bytes) -> str:
    digest = hmac.digest(secret.encode(), url.encode() + body, "sha256")
    return base64.b64encode(digest).decode()


class SquareGateway(GatewayBase):
    name = "square"
    signature_headers: tuple[str, ...] = (HEADER,)
    settings: Mapping[str, Setting] = MappingProxyType(
        {
            "notification_url": Setting(
                "the notification URL exactly as configured in the webhook subscription "
                "at Square (it is signed)",
                required=True,
            )
        }
    )
    #: Square signs no timestamp.
    tolerance: float | None = None
    #: Square retries for up to 72 hours.
    redelivery_window: float = 7 * DAY
    sample_type = "payment.updated"

    def generate_secret(self) -> str:
        """Square shows the signature key of a subscription; one made here is
        for tests and `payhook send`."""
        return random.token_urlsafe(16)

    def check_secret(self, secret: str) -> None:
        check_printable(secret, "a Square signature key")

    def check_config(self, config: Config) -> None:
        check_settings(self.settings, config)
        parts = urlsplit(config.settings["notification_url"])
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError("notification_url: expected the URL configured at Square")

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return json_text(body, "event_id")

    def new_event_id(self) -> str:
        return str(uuid.uuid4())

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
        given = signature_header(headers, HEADER)
        url = config.settings.get("notification_url")
        if not url:
            raise SignatureMismatch()  # an endpoint written by hand without it
        require_signature([given], secrets, lambda secret: sign(secret, url, body))

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        data = load_json_object(body)
        event_id = require_str(data, "event_id")
        event_type = require_str(data, "type")
        assert event_id is not None and event_type is not None
        digest = canonical_digest(data)
        occurred_at = iso_time(data.get("created_at"))
        container = data.get("data")
        objects = container.get("object") if isinstance(container, dict) else None
        name = event_type.split(".", 1)[0]
        obj = objects.get(name) if isinstance(objects, dict) else None
        obj = obj if isinstance(obj, dict) else {}
        status = obj.get("status") if name != "dispute" else obj.get("state")
        kind = _kind(event_type, status)
        if kind is None:
            meaning = object_meaning(event_type, obj.get("id"), status)
            return Event.ignored(event_id, event_type, occurred_at, digest, meaning=meaning)
        if occurred_at is None:
            raise MalformedEvent("created_at", "expected an ISO 8601 time")
        if name == "payment":
            order_id = require_str(obj, "id")
        elif name == "refund":
            order_id = require_str(obj, "payment_id")
        else:
            disputed = obj.get("disputed_payment")
            order_id = require_str(disputed if isinstance(disputed, dict) else {}, "payment_id")
        money = obj.get("amount_money")
        if not isinstance(money, dict):
            raise MalformedEvent("amount_money", "expected an object")
        event = Event(
            event_id=event_id,
            event_type=event_type,
            kind=kind,
            occurred_at=occurred_at,
            gateway_order_id=order_id,
            merchant_reference=require_str(obj, "reference_id", optional=True, limit=MAX_REFERENCE),
            amount_minor=require_amount(money, "amount"),
            currency=require_currency(money, "currency"),
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
        """An event as Square posts it. `payment.updated` is a COMPLETED
        payment, `payment.updated:FAILED` a failed one."""
        sample = one_event(samples)
        event_type, _, status = sample.event_type.partition(":")
        money = {"amount": sample.amount, "currency": sample.currency.upper()}
        created = datetime.fromtimestamp(sample.occurred_at, UTC).isoformat().replace("+00:00", "Z")
        name = event_type.split(".", 1)[0]
        obj: dict[str, Any]
        if name == "refund":
            obj = {
                "id": f"{sample.gateway_order_id}_{sample.event_id[:8]}",
                "payment_id": sample.gateway_order_id,
                "amount_money": money,
                "status": status or "COMPLETED",
            }
        elif name == "dispute":
            obj = {
                "id": f"dp_{sample.event_id[:12]}",
                "disputed_payment": {"payment_id": sample.gateway_order_id},
                "amount_money": money,
                "state": "EVIDENCE_REQUIRED",
            }
        else:
            obj = {
                "id": sample.gateway_order_id,
                "amount_money": money,
                "status": status or "COMPLETED",
            }
            if sample.merchant_reference:
                obj["reference_id"] = sample.merchant_reference
        event = {
            "merchant_id": "PAYHOOKTESTMERCHANT",
            "type": event_type,
            "event_id": sample.event_id,
            "created_at": created,
            "data": {"type": name, "id": obj["id"], "object": {name: obj}},
        }
        body = json.dumps(event, separators=(",", ":")).encode()
        url = config.settings.get("notification_url")
        if not url:
            raise ValueError("signing as Square takes --setting notification_url=URL")
        return body, {HEADER: sign(secret, url, body)}


def _kind(event_type: str, status: object) -> str | None:
    if event_type == "payment.updated":
        return {"COMPLETED": "succeeded", "FAILED": "failed"}.get(str(status))
    if event_type == "refund.updated":
        return "refunded" if status == "COMPLETED" else None
    if event_type == "dispute.created":
        return "disputed"
    return None
