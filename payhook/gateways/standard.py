"""Standard Webhooks (standardwebhooks.com).

Headers `webhook-id`, `webhook-timestamp` and `webhook-signature`, the last a
space-separated list of `v1,<base64>`; HMAC-SHA256 over
`{id}.{timestamp}.{body}` keyed with the base64-decoded `whsec_` secret.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import secrets as random
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from payhook.errors import MalformedEvent, MalformedHeaders, SignatureMismatch
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    MAX_SIGNATURE_HEADER,
    MAX_TEXT,
    NO_CONFIG,
    Config,
    Event,
    GatewayBase,
    Sample,
    any_signature_matches,
    canonical_digest,
    check_tolerance,
    load_json_object,
    one_event,
    raw_digest,
    require_amount,
    require_currency,
    require_str,
)

#: Seconds a signed timestamp may differ from our clock.
TOLERANCE = 300
SECRET_PREFIX = "whsec_"
TYPES = {
    "payment.succeeded": "succeeded",
    "payment.failed": "failed",
    "payment.refunded": "refunded",
    "payment.disputed": "disputed",
}


def generate_secret() -> str:
    """`whsec_` and the base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(random.token_bytes(32)).decode()


@functools.lru_cache(maxsize=4096)
def secret_key(secret: str) -> bytes:
    """The HMAC key a `whsec_` secret names; kept, as the ingress checks every
    request against the same few secrets."""
    encoded = secret.removeprefix(SECRET_PREFIX)
    padded = encoded + "=" * (-len(encoded) % 4)
    try:
        key = base64.b64decode(padded, validate=True)
    except ValueError:  # binascii.Error, or a secret that is not ASCII
        raise ValueError("a Standard Webhooks secret is whsec_ and base64") from None
    if not key:
        raise ValueError("a Standard Webhooks secret may not be empty")
    return key


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value for one secret."""
    content = f"{event_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


class StandardGateway(GatewayBase):
    name = "standard"
    signature_headers: tuple[str, ...] = ("webhook-id", "webhook-timestamp", "webhook-signature")
    tolerance: float = TOLERANCE
    #: Senders retry for about a day (the reference schedule ends after 27.5
    #: hours); payhook allows them 3.
    redelivery_window: float = 3 * DAY

    def generate_secret(self) -> str:
        return generate_secret()

    def check_secret(self, secret: str) -> None:
        secret_key(secret)

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return headers.get("webhook-id") or None

    sample_type = "payment.succeeded"

    def new_event_id(self) -> str:
        return f"msg_{uuid.uuid4().hex}"

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        sample = one_event(samples)
        data: dict[str, Any] = {
            "gateway_order_id": sample.gateway_order_id,
            "amount": sample.amount,
            "currency": sample.currency.upper(),
        }
        if sample.merchant_reference is not None:
            data["merchant_reference"] = sample.merchant_reference
        body = json.dumps(
            {
                "type": sample.event_type,
                "timestamp": datetime.fromtimestamp(sample.occurred_at, UTC).isoformat(),
                "data": data,
            }
        ).encode()
        headers = {
            "webhook-id": sample.event_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(secret, sample.event_id, timestamp, body),
        }
        return body, headers

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
        event_id, timestamp, signatures = _read_headers(headers)
        check_tolerance(timestamp, now, tolerance)
        content = _id_bytes(event_id) + f".{timestamp}.".encode() + body
        expected = [hmac.digest(key, content, "sha256") for key in _keys(secrets)]
        if not any_signature_matches(expected, signatures):
            raise SignatureMismatch()

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        event_id = headers.get("webhook-id", "")
        data = load_json_object(body)
        event_type = require_str(data, "type")
        assert event_type is not None
        kind = TYPES.get(event_type)
        digest = canonical_digest(data)
        occurred_at = _parse_time(data.get("timestamp"))
        payment = data.get("data")
        if kind is None:
            return Event.ignored(event_id, event_type, occurred_at, digest)
        if occurred_at is None:
            # The horizon guard judges an event by this time: without it, an
            # event of any age would pass.
            raise MalformedEvent("timestamp", "expected an ISO 8601 time with its UTC offset")
        if not isinstance(payment, dict):
            raise MalformedEvent("data", "expected an object")
        return Event(
            event_id=event_id,
            event_type=event_type,
            kind=kind,
            occurred_at=occurred_at,
            gateway_order_id=require_str(payment, "gateway_order_id"),
            merchant_reference=require_str(
                payment, "merchant_reference", optional=True, limit=MAX_REFERENCE
            ),
            amount_minor=require_amount(payment, "amount"),
            currency=require_currency(payment, "currency"),
            digest=digest,
        )

    def unreadable_digest(self, body: bytes) -> str:
        """The exact bytes: a Standard Webhooks redelivery repeats them."""
        return raw_digest(body)


def _id_bytes(event_id: str) -> bytes:
    """The bytes of the id as the sender signed them. A header value reaches
    us decoded as latin-1, byte for byte, so encoding it back gives the exact
    bytes sent (a non-ASCII id arrives as its UTF-8 bytes); an id that cannot
    have come from a header is taken as UTF-8, as signers encode it."""
    try:
        return event_id.encode("latin-1")
    except UnicodeEncodeError:
        return event_id.encode()


def _keys(secrets: Sequence[str]) -> list[bytes]:
    """The HMAC keys of `secrets`, passing over any that is not a `whsec_` secret
    (the commands refuse one; a row written otherwise must not stop the others)."""
    keys = []
    for secret in secrets:
        try:
            keys.append(secret_key(secret))
        except (ValueError, AttributeError):  # AttributeError: not a string at all
            continue
    return keys


def _read_headers(headers: Mapping[str, str]) -> tuple[str, int, list[bytes]]:
    event_id = headers.get("webhook-id", "")
    raw_timestamp = headers.get("webhook-timestamp", "")
    raw_signature = headers.get("webhook-signature", "")
    if not event_id or len(event_id) > MAX_TEXT or not raw_signature:
        raise MalformedHeaders()
    if len(raw_signature) > MAX_SIGNATURE_HEADER:
        raise MalformedHeaders()
    if not raw_timestamp.isascii() or not raw_timestamp.isdigit() or len(raw_timestamp) > 12:
        raise MalformedHeaders()
    signatures: list[bytes] = []
    for entry in raw_signature.split():
        scheme, _, value = entry.partition(",")
        if scheme != "v1":
            continue  # unknown schemes (v1a, future versions) are ignored
        try:
            signatures.append(base64.b64decode(value, validate=True))
        except ValueError:  # binascii.Error, or a value that is not ASCII
            continue
    return event_id, int(raw_timestamp), signatures


def _parse_time(value: object) -> datetime | None:
    """An ISO 8601 time with its offset (`Z` or `z` for UTC, as RFC 3339
    allows); None for anything else, a time without an offset included: its
    instant is unknown."""
    if not isinstance(value, str):
        return None
    if value[-1:] in ("Z", "z"):
        value = value[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else None
