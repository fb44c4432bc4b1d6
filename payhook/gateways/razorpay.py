"""Razorpay webhooks.

`X-Razorpay-Signature` is the hex HMAC-SHA256 of the raw body, keyed with the
webhook secret (`razorpay.Utility.verify_webhook_signature` checks the
same). Razorpay names each event in `X-Razorpay-Event-Id`, a header its
signature does not cover: anyone who had a signed body could send it again
under a new id. So payhook keys an event by what the signed body says it is,
`{event}:{entity id}` (`payment.captured:pay_...`, `refund.processed:rfnd_...`),
which Razorpay's retries repeat and a replay cannot change; the header's id
is logged.
"""

from __future__ import annotations

import dataclasses
import json
import secrets as random
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from payhook.errors import MalformedEvent
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    NO_CONFIG,
    BodyHmacGateway,
    Config,
    Event,
    Sample,
    canonical_digest,
    check_printable,
    hex_hmac_sha256,
    load_json_object,
    meaning_digest,
    object_meaning,
    one_event,
    require_amount,
    require_currency,
    require_str,
)

TYPES = {
    "payment.captured": "succeeded",
    "payment.failed": "failed",
    "refund.processed": "refunded",
    "payment.dispute.created": "disputed",
}
#: The entity each event type is about, in `payload`.
ENTITIES = {"refund.processed": "refund", "payment.dispute.created": "dispute"}


#: The `X-Razorpay-Signature` of a body under a secret.
sign = hex_hmac_sha256


class RazorpayGateway(BodyHmacGateway):
    name = "razorpay"
    signature_headers: tuple[str, ...] = ("x-razorpay-signature", "x-razorpay-event-id")
    hmac_header = "x-razorpay-signature"
    #: Razorpay signs no timestamp.
    tolerance: float | None = None
    #: Razorpay retries for 24 hours after the event.
    redelivery_window: float = 7 * DAY
    sample_type = "payment.captured"

    def generate_secret(self) -> str:
        """The merchant chooses the secret in Razorpay's Dashboard; one made
        here is for tests and `payhook send`."""
        return random.token_urlsafe(24)

    def check_secret(self, secret: str) -> None:
        check_printable(secret, "a Razorpay webhook secret")

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return headers.get("x-razorpay-event-id") or None

    def new_event_id(self) -> str:
        return random.token_hex(8)

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        data = load_json_object(body)
        event_type = require_str(data, "event")
        assert event_type is not None
        digest = canonical_digest(data)
        created = data.get("created_at")
        occurred_at = (
            datetime.fromtimestamp(created, UTC)
            if type(created) is int and 0 < created < 2**35
            else None
        )
        payload = data.get("payload")
        payload = payload if isinstance(payload, dict) else {}
        name = ENTITIES.get(event_type, event_type.split(".", 1)[0])
        entity = _entity(payload, name)
        entity_id = require_str(entity, "id")
        assert entity_id is not None
        event_id = f"{event_type}:{entity_id}"
        kind = TYPES.get(event_type)
        if kind is None:
            meaning = object_meaning(event_type, entity_id)
            return Event.ignored(event_id, event_type, occurred_at, digest, meaning=meaning)
        if occurred_at is None:
            raise MalformedEvent("created_at", "expected a Unix time in seconds")
        payment = entity if name == "payment" else _entity(payload, "payment", required=False)
        payment_id = require_str(entity, "id" if name == "payment" else "payment_id")
        # Razorpay's order, which the merchant made before the checkout;
        # else the payment's own id.
        order_id = payment.get("order_id") if isinstance(payment.get("order_id"), str) else None
        notes = payment.get("notes")
        event = Event(
            event_id=event_id,
            event_type=event_type,
            kind=kind,
            occurred_at=occurred_at,
            gateway_order_id=order_id or payment_id,
            merchant_reference=require_str(notes, "order_id", optional=True, limit=MAX_REFERENCE)
            if isinstance(notes, dict)
            else None,
            amount_minor=require_amount(entity, "amount"),
            currency=require_currency(entity, "currency"),
            digest=digest,
        )
        return dataclasses.replace(event, meaning=meaning_digest(event, entity.get("status")))

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        """An event as Razorpay posts it; the gateway order id is Razorpay's
        order (`order_...`), its payment derived from the event id."""
        sample = one_event(samples)
        payment_id = "pay_" + sample.event_id[:14]
        notes: dict[str, Any] | list[Any] = (
            {"order_id": sample.merchant_reference} if sample.merchant_reference else []
        )
        payment = {
            "id": payment_id,
            "entity": "payment",
            "amount": sample.amount,
            "currency": sample.currency.upper(),
            "status": "failed" if sample.event_type == "payment.failed" else "captured",
            "order_id": sample.gateway_order_id,
            "notes": notes,
        }
        payload: dict[str, Any] = {"payment": {"entity": payment}}
        contains = ["payment"]
        common = {
            "amount": sample.amount,
            "currency": sample.currency.upper(),
            "payment_id": payment_id,
        }
        if sample.event_type == "refund.processed":
            refund = {
                "id": "rfnd_" + sample.event_id[:14],
                "entity": "refund",
                "status": "processed",
            }
            payload["refund"] = {"entity": refund | common}
            contains.insert(0, "refund")
        elif sample.event_type == "payment.dispute.created":
            dispute = {"id": "disp_" + sample.event_id[:14], "entity": "dispute", "status": "open"}
            payload["dispute"] = {"entity": dispute | common}
            contains.insert(0, "dispute")
        event = {
            "entity": "event",
            "account_id": "acc_PayhookTest01",
            "event": sample.event_type,
            "contains": contains,
            "payload": payload,
            "created_at": sample.occurred_at,
        }
        body = json.dumps(event, separators=(",", ":")).encode()
        return body, {
            "x-razorpay-signature": sign(secret, body),
            "x-razorpay-event-id": sample.event_id,
        }


def _entity(payload: Mapping[str, Any], name: str, *, required: bool = True) -> dict[str, Any]:
    wrapper = payload.get(name)
    entity = wrapper.get("entity") if isinstance(wrapper, dict) else None
    if isinstance(entity, dict):
        return entity
    if required:
        raise MalformedEvent(f"payload.{name}.entity", "expected an object")
    return {}
