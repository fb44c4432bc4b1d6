"""Stripe webhooks.

Header `Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>...]`, HMAC-SHA256 over
`{t}.{body}` keyed with the endpoint secret as it is. The event id is the
body's `id`. Stripe rewrites delivery fields between redeliveries, so the
digest leaves them out.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import secrets as random
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import stripe

from payhook.errors import (
    GatewayUnavailable,
    MalformedEvent,
    MalformedHeaders,
    RateLimited,
    SignatureMismatch,
)
from payhook.gateways import api
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    MAX_SIGNATURE_HEADER,
    NO_CONFIG,
    Config,
    Event,
    GatewayBase,
    Page,
    Sample,
    Setting,
    any_signature_matches,
    canonical_digest,
    check_settings,
    check_tolerance,
    json_text,
    load_json_object,
    meaning_digest,
    one_event,
    raw_digest,
    require_amount,
    require_currency,
    require_str,
)

#: Seconds a signed timestamp may differ from our clock (Stripe's default).
TOLERANCE = 300
#: Characters after `whsec_` a Stripe secret has at least (Stripe's have 32).
MIN_SECRET = 16
#: Top-level fields Stripe changes from one delivery of an event to the next.
DELIVERY_FIELDS = frozenset({"pending_webhooks", "request"})
TYPES = {
    "payment_intent.succeeded": "succeeded",
    "payment_intent.payment_failed": "failed",
    "charge.refunded": "refunded",
    "charge.dispute.created": "disputed",
}


#: Stripe's API, and events listed a page.
API_BASE = "https://api.stripe.com"
PAGE = 100


def stripe_client(key: str, base: str, timeout: float) -> stripe.StripeClient:
    """Stripe's client for `base`, retrying nothing on its own (`reconcile` does)."""
    return stripe.StripeClient(
        key,
        base_addresses={"api": base},
        max_network_retries=0,
        http_client=stripe.HTTPXClient(timeout=timeout, allow_sync_methods=True),
    )


def _retry_after(headers: Mapping[str, str] | None) -> float:
    """Seconds a 429 asks to wait (`Retry-After`), 1 when it does not say."""
    value = (headers or {}).get("retry-after") or (headers or {}).get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else 1.0
    except ValueError:
        return 1.0


def generate_secret() -> str:
    return "whsec_" + base64.b32encode(random.token_bytes(20)).decode().lower().rstrip("=")


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The `Stripe-Signature` header value for one secret."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={digest.hexdigest()}"


class StripeGateway(GatewayBase):
    name = "stripe"
    signature_headers: tuple[str, ...] = ("stripe-signature",)
    settings: Mapping[str, Setting] = MappingProxyType(
        {
            "api_key": Setting(
                "a restricted API key that may read events, for `payhook reconcile`",
                credential=True,
            ),
            "api_base_url": Setting(f"Stripe's API (default {API_BASE})"),
        }
    )
    tolerance: float = TOLERANCE
    #: Stripe retries for 3 days and lets anyone list and resend an event for 30.
    redelivery_window: float = 30 * DAY

    def check_config(self, config: Config) -> None:
        check_settings(self.settings, config)
        api.base_url(config, API_BASE)

    def list_events(
        self, config: Config, since: datetime, after: str | None, timeout: float
    ) -> Page:
        """`GET /v1/events` through Stripe's client: events created since
        `since`, newest first, 100 a page."""
        key = config.credentials.get("api_key")
        if not key:
            raise GatewayUnavailable("events: the endpoint has no api_key that opens")
        try:
            base = api.base_url(config, API_BASE)
        except ValueError as exc:
            raise GatewayUnavailable(str(exc)) from None
        client = stripe_client(key, base, timeout)
        params: dict[str, Any] = {"created": {"gte": int(since.timestamp())}, "limit": PAGE}
        if after is not None:
            params["starting_after"] = after
        try:
            page = client.v1.events.list(params=params)  # type: ignore[arg-type]
        except stripe.RateLimitError as exc:
            retry_after = _retry_after(exc.headers)
            raise RateLimited(
                f"GET /v1/events: 429, again in {retry_after:g}s", retry_after
            ) from None
        except stripe.StripeError as exc:
            status = getattr(exc, "http_status", None)
            raise GatewayUnavailable(
                f"GET /v1/events: {status or exc.__class__.__name__}"
            ) from None
        return Page([event.to_dict() for event in page.data], bool(page.has_more))

    def event_id_of(self, event: Mapping[str, Any]) -> str:
        return str(event.get("id"))

    def acts_on(self, event: Mapping[str, Any]) -> bool:
        return event.get("type") in TYPES

    def generate_secret(self) -> str:
        return generate_secret()

    def check_secret(self, secret: str) -> None:
        """A Stripe secret, used as it is, is `whsec_` and at least
        MIN_SECRET more characters, none of them blank: a short or mistyped
        key is one anybody could guess."""
        if (
            not secret.startswith("whsec_")
            or len(secret) < len("whsec_") + MIN_SECRET
            or any(c.isspace() for c in secret)
        ):
            raise ValueError(
                f"a Stripe signing secret is whsec_ and at least {MIN_SECRET} more "
                "characters, without spaces (copy it from the endpoint's page at Stripe)"
            )

    sample_type = "payment_intent.succeeded"

    def new_event_id(self) -> str:
        return f"evt_{uuid.uuid4().hex[:24]}"

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        sample = one_event(samples)
        body = _sample_body(sample)
        return body, {"stripe-signature": sign(secret, timestamp, body)}

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return json_text(body, "id")

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
        timestamp, signatures = _read_header(headers.get("stripe-signature", ""))
        check_tolerance(timestamp, now, tolerance)
        content = f"{timestamp}.".encode() + body
        expected = [
            hmac.digest(secret.encode(), content, "sha256").hex().encode()
            for secret in secrets
            # A row written by hand may hold a NULL or an empty secret: an
            # empty key is one anybody can sign with.
            if isinstance(secret, str) and secret
        ]
        if not any_signature_matches(expected, signatures):
            raise SignatureMismatch()

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        data = load_json_object(body)
        event_id = require_str(data, "id")
        event_type = require_str(data, "type")
        assert event_id is not None and event_type is not None
        digest = _business_digest(data)
        created = data.get("created")
        occurred_at = (
            datetime.fromtimestamp(created, UTC)
            if isinstance(created, int) and not isinstance(created, bool) and 0 < created < 2**35
            else None
        )
        kind = TYPES.get(event_type)
        if kind is None:
            # An event payhook does not act on means its type and its object.
            container = data.get("data")
            obj = container.get("object") if isinstance(container, dict) else None
            object_id = obj.get("id") if isinstance(obj, dict) else None
            meaning = canonical_digest(
                {
                    "event_type": event_type,
                    "object": object_id if isinstance(object_id, str) else None,
                }
            )
            return Event.ignored(event_id, event_type, occurred_at, digest, meaning=meaning)
        if occurred_at is None:
            # The horizon guard judges an event by this time: without it, an
            # event of any age would pass.
            raise MalformedEvent("created", "expected a Unix time in seconds")
        container = data.get("data")
        obj = container.get("object") if isinstance(container, dict) else None
        if not isinstance(obj, dict):
            raise MalformedEvent("data.object", "expected an object")
        metadata = obj.get("metadata")
        reference = (
            require_str(metadata, "order_id", optional=True, limit=MAX_REFERENCE)
            if isinstance(metadata, dict)
            else None
        )
        if event_type == "payment_intent.succeeded" and "amount_received" in obj:
            # What was captured: after a partial capture less than `amount`,
            # which must not pay (and fulfil) the whole order.
            order_id, amount = require_str(obj, "id"), require_amount(obj, "amount_received")
        elif event_type.startswith("payment_intent."):
            order_id, amount = require_str(obj, "id"), require_amount(obj, "amount")
        elif event_type == "charge.refunded":
            # A charge made with the Charges API has no PaymentIntent (null,
            # or no key in API versions before PaymentIntents): its order
            # is known by the charge's own id.
            order_id = _payment_intent(obj) or require_str(obj, "id")
            amount = require_amount(obj, "amount_refunded")
        else:
            # A dispute always names its charge, its PaymentIntent only when
            # the charge had one.
            order_id = _payment_intent(obj) or _object_id(obj, "charge")
            amount = require_amount(obj, "amount")
        event = Event(
            event_id=event_id,
            event_type=event_type,
            kind=kind,
            occurred_at=occurred_at,
            gateway_order_id=order_id,
            merchant_reference=reference,
            amount_minor=amount,
            currency=require_currency(obj, "currency"),
            digest=digest,
            cumulative=event_type == "charge.refunded",
        )
        # The same event sent to endpoints pinned to other API versions is
        # rendered otherwise; what it means is the same.
        return dataclasses.replace(event, meaning=meaning_digest(event, obj.get("status")))

    def unreadable_digest(self, body: bytes) -> str:
        """A JSON object's business content, as `parse` digests it: Stripe
        rewrites the delivery fields on every redelivery. Other bytes as they are."""
        try:
            return _business_digest(load_json_object(body))
        except (MalformedEvent, RecursionError):
            return raw_digest(body)


#: Stripe's API version stamped on the events `payhook send` sends.
SAMPLE_API_VERSION = "2024-06-20"


def _sample_body(sample: Sample) -> bytes:
    """A Stripe event object as Stripe posts it, for the object its type names."""
    currency = sample.currency.lower()
    metadata = {"order_id": sample.merchant_reference} if sample.merchant_reference else {}
    obj: dict[str, Any]
    if sample.event_type.startswith("charge.dispute."):
        obj = {
            "id": _sample_object_id("dp", sample),
            "object": "dispute",
            "amount": sample.amount,
            "charge": _sample_object_id("ch", sample),
            "currency": currency,
            "payment_intent": sample.gateway_order_id,
            "reason": "fraudulent",
            "status": "needs_response",
            "metadata": metadata,
        }
    elif sample.event_type.startswith("charge."):
        refunded = sample.event_type == "charge.refunded"
        obj = {
            "id": _sample_object_id("ch", sample),
            "object": "charge",
            "amount": sample.amount,
            "amount_captured": sample.amount,
            "amount_refunded": sample.amount if refunded else 0,
            "currency": currency,
            "payment_intent": sample.gateway_order_id,
            "refunded": refunded,
            "status": "succeeded",
            "metadata": metadata,
        }
    else:
        failed = sample.event_type == "payment_intent.payment_failed"
        obj = {
            "id": sample.gateway_order_id,
            "object": "payment_intent",
            "amount": sample.amount,
            "amount_received": 0 if failed else sample.amount,
            "currency": currency,
            "status": "requires_payment_method" if failed else "succeeded",
            "last_payment_error": {"code": "card_declined"} if failed else None,
            "metadata": metadata,
        }
    payload = {
        "id": sample.event_id,
        "object": "event",
        "api_version": SAMPLE_API_VERSION,
        "created": sample.occurred_at,
        "data": {"object": obj},
        "livemode": False,
        "pending_webhooks": 1,
        "request": {"id": None, "idempotency_key": None},
        "type": sample.event_type,
    }
    return json.dumps(payload).encode()


def _sample_object_id(prefix: str, sample: Sample) -> str:
    """A Stripe object id: new for a new event, the same for every send of a given id."""
    if not sample.repeated:
        return f"{prefix}_{uuid.uuid4().hex[:24]}"
    return f"{prefix}_{hashlib.sha256(f'{prefix}:{sample.event_id}'.encode()).hexdigest()[:24]}"


def _payment_intent(obj: Mapping[str, Any]) -> str | None:
    """The object's PaymentIntent id; None when it has none."""
    if obj.get("payment_intent") is None:
        return None
    return _object_id(obj, "payment_intent")


def _object_id(obj: Mapping[str, Any], key: str) -> str:
    """The id `obj[key]` names: a string, or the id of an expanded object."""
    value = obj.get(key)
    if isinstance(value, dict):
        found = require_str(value, "id")
        assert found is not None
        return found
    found = require_str(obj, key)
    assert found is not None
    return found


def _business_digest(data: dict[str, Any]) -> str:
    """The digest of an event without what Stripe changes between deliveries."""
    return canonical_digest({k: v for k, v in data.items() if k not in DELIVERY_FIELDS})


def _read_header(header: str) -> tuple[int, list[bytes]]:
    if len(header) > MAX_SIGNATURE_HEADER:
        raise MalformedHeaders()
    timestamp: int | None = None
    signatures: list[bytes] = []
    for item in header.split(","):
        key, _, value = item.strip().partition("=")
        if key == "t":
            if not value.isascii() or not value.isdigit() or len(value) > 12:
                raise MalformedHeaders()
            timestamp = int(value)
        elif key == "v1":
            signatures.append(value.encode())
        # other schemes (v0, ...) are ignored
    if timestamp is None:
        raise MalformedHeaders()
    return timestamp, signatures
