"""Mollie webhooks, signed and classic.

Signed webhooks (Mollie's webhook events) carry `X-Mollie-Signature:
sha256=<hex>`, HMAC-SHA256 of the raw body keyed with the webhook's signing
secret, two of them while Mollie rotates it (`mollie.utils.webhooks.
SignatureValidator` checks the same). Classic webhooks are a form POST of
one `id` (`id=tr_...`) and carry no signature: an endpoint accepts them only
with the `classic_webhooks` setting, and then the request proves nothing.

Either way a webhook only says that a payment changed. Before any
transaction the consumer reads the payment from Mollie's API with the
endpoint's API key, and applies what the API says of it, each fact under an
id derived from it: `{payment}:paid`, `{payment}:refunded:{total}` (a
cumulative refund), `{payment}:chargeback:{total}`, `{payment}:{status}`
for a failed, expired or canceled one. A signed event, a classic webhook and
their retries for the same payment are therefore the same events, applied
once; a forged classic webhook names a payment the API does not know (the
job is retried, then kept in the dead-letter queue) or one it does, whose
facts are true.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import secrets as random
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from payhook import money
from payhook.errors import GatewayUnavailable, MalformedEvent, MalformedHeaders
from payhook.gateways import api
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    MAX_SIGNATURE_HEADER,
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
    raw_digest,
    require_currency,
    require_signature,
    require_str,
)

HEADER = "x-mollie-signature"
LIVE_API = "https://api.mollie.com"
#: A payment's id, as a classic webhook names it.
PAYMENT_ID = re.compile(r"tr_[A-Za-z0-9]{1,64}")
#: Payment statuses that end it unpaid.
UNPAID = frozenset({"failed", "expired", "canceled"})
#: Signed event types that name a payment (others name its refund or chargeback).
PAYMENT_EVENTS = frozenset(
    {"payment.paid", "payment.failed", "payment.expired", "payment.canceled"}
)
#: The event types payhook reads; anything else is recorded and ignored.
EVENT_TYPES = PAYMENT_EVENTS | {"refund.refunded", "chargeback.received"}


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class MollieGateway(GatewayBase):
    name = "mollie"
    signature_headers: tuple[str, ...] = (HEADER,)
    settings: Mapping[str, Setting] = MappingProxyType(
        {
            "api_key": Setting(
                "a Mollie API key (live_... or test_...) to read the payments webhooks name",
                credential=True,
                required=True,
            ),
            "api_base_url": Setting(f"Mollie's API (default {LIVE_API})"),
            "classic_webhooks": Setting(
                "true: also accept classic, unsigned webhooks (id=tr_...), verified only "
                "by reading the payment from the API"
            ),
        }
    )
    #: Mollie signs no timestamp.
    tolerance: float | None = None
    #: Mollie retries for about a day.
    redelivery_window: float = 7 * DAY
    sample_type = "payment.paid"

    def generate_secret(self) -> str:
        return random.token_urlsafe(32)

    def check_secret(self, secret: str) -> None:
        check_printable(secret, "a Mollie signing secret")

    def check_config(self, config: Config) -> None:
        check_settings(self.settings, config)
        api_base_url(config)
        if config.settings.get("classic_webhooks", "false") not in ("true", "false"):
            raise ValueError("classic_webhooks: expected true or false")

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        classic = _classic_id(body)
        return json_text(body, "id") if classic is None else f"{classic}:webhook"

    def new_event_id(self) -> str:
        return "whe_" + random.token_hex(6)

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
        header = headers.get(HEADER, "")
        if not header:
            if config.settings.get("classic_webhooks") == "true" and _classic_id(body):
                return  # proves nothing: the consumer reads the payment
            raise MalformedHeaders()
        if len(header) > MAX_SIGNATURE_HEADER:
            raise MalformedHeaders()
        given = [
            part.strip().encode("latin-1", "replace") for part in header.split(",") if part.strip()
        ]
        given = [g if g.startswith(b"sha256=") else b"sha256=" + g for g in given]
        require_signature(given, secrets, lambda secret: sign(secret, body))

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        classic = _classic_id(body)
        if classic is not None:
            return _trigger(f"{classic}:webhook", "payment.webhook", classic, raw_digest(body))
        data = load_json_object(body)
        event_id = require_str(data, "id")
        event_type = require_str(data, "type")
        assert event_id is not None and event_type is not None
        digest = canonical_digest(data)
        if event_type not in EVENT_TYPES:
            meaning = object_meaning(event_type, data.get("entityId"))
            return Event.ignored(
                event_id, event_type, iso_time(data.get("createdAt")), digest, meaning=meaning
            )
        if event_type in PAYMENT_EVENTS:
            payment = require_str(data, "entityId")
        else:
            # A refund's or a chargeback's event names its payment in the
            # entity it embeds (a subscription with full payloads).
            embedded = data.get("_embedded")
            entity = embedded.get("entity") if isinstance(embedded, dict) else None
            payment = require_str(entity if isinstance(entity, dict) else {}, "paymentId")
        assert payment is not None
        return _trigger(event_id, event_type, payment, digest)

    def complete(self, event: Event, config: Config, timeout: float) -> list[Event]:
        payment_id = event.links_to
        if payment_id is None or not PAYMENT_ID.fullmatch(payment_id):
            raise MalformedEvent("entityId", "expected a payment id (tr_...)")
        payment = fetch_payment(config, payment_id, timeout)
        return payment_events(payment_id, payment)

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        """A signed webhook event naming the payment (the gateway order id,
        `tr_...`); `classic` sends a classic, unsigned webhook of its id."""
        sample = one_event(samples)
        if sample.event_type == "classic":
            body = urlencode({"id": sample.gateway_order_id}).encode()
            return body, {"content-type": "application/x-www-form-urlencoded"}
        created = datetime.fromtimestamp(sample.occurred_at, UTC).isoformat()
        event: dict[str, Any] = {
            "resource": "event",
            "id": sample.event_id,
            "type": sample.event_type,
            "entityId": sample.gateway_order_id,
            "createdAt": created,
        }
        if sample.event_type not in PAYMENT_EVENTS:
            entity_id = "re_" + sample.event_id[4:]
            event["entityId"] = entity_id
            event["_embedded"] = {"entity": {"id": entity_id, "paymentId": sample.gateway_order_id}}
        body = json.dumps(event, separators=(",", ":")).encode()
        return body, {HEADER: sign(secret, body)}


def _trigger(event_id: str, event_type: str, payment: str, digest: str) -> Event:
    """A webhook that names a payment, before the API says what it means."""
    return Event(
        event_id=event_id,
        event_type=event_type,
        kind=None,
        occurred_at=None,
        gateway_order_id=None,
        merchant_reference=None,
        amount_minor=None,
        currency=None,
        digest=digest,
        meaning=object_meaning(event_type, payment),
        links_to=payment,
    )


def _classic_id(body: bytes) -> str | None:
    """The payment a classic webhook names: a form of one `id=tr_...`."""
    if len(body) > 200:
        return None
    try:
        fields = parse_qs(body.decode("ascii"), strict_parsing=True, max_num_fields=2)
    except (UnicodeDecodeError, ValueError):
        return None
    values = fields.get("id", [])
    if set(fields) != {"id"} or len(values) != 1 or not PAYMENT_ID.fullmatch(values[0]):
        return None
    return values[0]


def api_base_url(config: Config) -> str:
    return api.base_url(config, LIVE_API)


def fetch_payment(config: Config, payment_id: str, timeout: float) -> dict[str, Any]:
    """`GET {api}/v2/payments/{id}`; `GatewayUnavailable` on any failure."""
    key = config.credentials.get("api_key")
    if not key:
        raise GatewayUnavailable("payments: the endpoint has no api_key that opens")
    path = f"/v2/payments/{quote(payment_id, safe='')}"
    payment = api.get_json(config, LIVE_API, path, {"authorization": f"Bearer {key}"}, timeout)
    if not isinstance(payment, dict) or payment.get("id") != payment_id:
        raise GatewayUnavailable(f"GET {path}: not that payment")
    return payment


def payment_events(payment_id: str, payment: Mapping[str, Any]) -> list[Event]:
    """What a payment, as Mollie's API gives it, says happened, in order."""
    status = payment.get("status")
    amount = _amount(payment, "amount")
    assert amount is not None
    minor, currency = amount
    metadata = payment.get("metadata")
    reference = (
        require_str(metadata, "order_id", optional=True, limit=MAX_REFERENCE)
        if isinstance(metadata, dict)
        else None
    )
    created = iso_time(payment.get("createdAt"))
    if created is None:
        raise MalformedEvent("createdAt", "expected an ISO 8601 time")

    def fact(
        name: str, kind: str | None, value: int, at: object, cumulative: bool = False
    ) -> Event:
        content = {"payment": payment_id, "fact": name, "amount": value, "currency": currency}
        event = Event(
            event_id=f"{payment_id}:{name}",
            event_type=f"payment.{name.split(':')[0]}",
            kind=kind,
            occurred_at=iso_time(at) or created,
            gateway_order_id=payment_id,
            merchant_reference=reference,
            amount_minor=value,
            currency=currency,
            digest=canonical_digest(content),
            cumulative=cumulative,
        )
        return dataclasses.replace(event, meaning=meaning_digest(event, name))

    events = []
    if payment.get("paidAt") or status == "paid":
        events.append(fact("paid", "succeeded", minor, payment.get("paidAt")))
    elif status in UNPAID:
        events.append(fact(str(status), "failed", minor, payment.get(f"{status}At")))
    refunded = _amount(payment, "amountRefunded", optional=True)
    if refunded is not None and refunded[0] > 0:
        events.append(fact(f"refunded:{refunded[0]}", "refunded", refunded[0], None, True))
    charged_back = _amount(payment, "amountChargedBack", optional=True)
    if charged_back is not None and charged_back[0] > 0:
        events.append(fact(f"chargeback:{charged_back[0]}", "disputed", charged_back[0], None))
    if not events:
        # Open, pending, authorized: nothing to apply yet; recorded.
        events.append(fact(str(status), None, minor, None))
    return events


def _amount(
    payment: Mapping[str, Any], field: str, *, optional: bool = False
) -> tuple[int, str] | None:
    value = payment.get(field)
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise MalformedEvent(field, "expected an amount object")
    currency = require_currency(value, "currency")
    decimal = value.get("value")
    try:
        return money.minor_units(decimal if isinstance(decimal, str) else "", currency), currency
    except ValueError as exc:
        raise MalformedEvent(f"{field}.value", str(exc)) from None
