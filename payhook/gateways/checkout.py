"""Checkout.com webhooks.

`Cko-Signature` is the hex HMAC-SHA256 of the raw body, keyed with the
webhook's signature key. A webhook may also send a fixed `Authorization`
header value; when the endpoint has the `authorization` credential, it must
match. No Checkout.com library verifies webhooks: the documented rule is the
vector.
"""

from __future__ import annotations

import dataclasses
import json
import secrets as random
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from payhook.errors import MalformedEvent, SignatureMismatch
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    NO_CONFIG,
    BodyHmacGateway,
    Config,
    Event,
    Sample,
    Setting,
    canonical_digest,
    check_printable,
    hex_hmac_sha256,
    iso_time,
    json_text,
    load_json_object,
    meaning_digest,
    object_meaning,
    one_event,
    require_amount,
    require_currency,
    require_str,
    same_bytes,
)

TYPES = {
    "payment_captured": "succeeded",
    "payment_declined": "failed",
    "payment_capture_declined": "failed",
    "payment_refunded": "refunded",
    # The first notice of a dispute; `dispute_received` in older documents.
    "dispute_evidence_required": "disputed",
    "dispute_received": "disputed",
}


#: The `Cko-Signature` of a body under a secret.
sign = hex_hmac_sha256


class CheckoutGateway(BodyHmacGateway):
    name = "checkout"
    signature_headers: tuple[str, ...] = ("cko-signature", "authorization")
    hmac_header = "cko-signature"
    settings: Mapping[str, Setting] = MappingProxyType(
        {
            "authorization": Setting(
                "the fixed Authorization header value configured on the webhook",
                credential=True,
                verifies=True,
            )
        }
    )
    #: Checkout.com signs no timestamp.
    tolerance: float | None = None
    #: Checkout.com resends 8 times over about a day and a half.
    redelivery_window: float = 7 * DAY
    sample_type = "payment_captured"

    def generate_secret(self) -> str:
        return random.token_hex(32)

    def check_secret(self, secret: str) -> None:
        check_printable(secret, "a Checkout.com signature key")

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return json_text(body, "id")

    def new_event_id(self) -> str:
        return "evt_" + random.token_hex(13)

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
        super().verify(headers, body, secrets, now=now, tolerance=tolerance, config=config)
        # A credential that did not open is there, empty: nothing matches it.
        if "authorization" in config.credentials:
            expected = config.credentials["authorization"].encode()
            given = headers.get("authorization", "").encode("latin-1", "replace")
            if not expected or not same_bytes(expected, given):
                raise SignatureMismatch()

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        data = load_json_object(body)
        event_id = require_str(data, "id")
        event_type = require_str(data, "type")
        assert event_id is not None and event_type is not None
        digest = canonical_digest(data)
        occurred_at = iso_time(data.get("created_on") or data.get("timestamp"))
        obj = data.get("data")
        obj = obj if isinstance(obj, dict) else {}
        kind = TYPES.get(event_type)
        if kind is None:
            meaning = object_meaning(event_type, obj.get("id"))
            return Event.ignored(event_id, event_type, occurred_at, digest, meaning=meaning)
        if occurred_at is None:
            raise MalformedEvent("created_on", "expected an ISO 8601 time")
        disputed = kind == "disputed"
        event = Event(
            event_id=event_id,
            event_type=event_type,
            kind=kind,
            occurred_at=occurred_at,
            gateway_order_id=require_str(obj, "payment_id" if disputed else "id"),
            merchant_reference=require_str(
                obj,
                "payment_reference" if disputed else "reference",
                optional=True,
                limit=MAX_REFERENCE,
            ),
            amount_minor=require_amount(obj, "amount"),
            currency=require_currency(obj, "currency"),
            digest=digest,
        )
        return dataclasses.replace(event, meaning=meaning_digest(event, obj.get("action_id")))

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        sample = one_event(samples)
        created = datetime.fromtimestamp(sample.occurred_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        obj: dict[str, Any] = {"amount": sample.amount, "currency": sample.currency.upper()}
        if sample.event_type.startswith("dispute_"):
            obj |= {"id": "dsp_" + sample.event_id[4:20], "payment_id": sample.gateway_order_id}
            if sample.merchant_reference:
                obj["payment_reference"] = sample.merchant_reference
        else:
            obj |= {"id": sample.gateway_order_id, "action_id": "act_" + sample.event_id[4:]}
            if sample.merchant_reference:
                obj["reference"] = sample.merchant_reference
        body = json.dumps(
            {"id": sample.event_id, "type": sample.event_type, "created_on": created, "data": obj},
            separators=(",", ":"),
        ).encode()
        headers = {"cko-signature": sign(secret, body)}
        if config.credentials.get("authorization"):
            headers["authorization"] = config.credentials["authorization"]
        return body, headers
