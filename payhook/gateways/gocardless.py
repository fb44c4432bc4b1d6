"""GoCardless webhooks.

A request is `{"events": [...], "meta": {...}}`, up to hundreds of events,
signed whole: `Webhook-Signature` is the hex HMAC-SHA256 of the raw body,
keyed with the endpoint's secret (`gocardless_pro.webhooks.parse` checks the
same). A request that is not authentic is answered 498, as GoCardless asks;
an accepted one 204.

An event only links to its resource (`links.payment`, `links.refund`): it
names no amount. Before its transaction, the consumer reads the resource
from the GoCardless API (`GET /payments/{id}`, `GET /refunds/{id}`) with the
endpoint's access token, and never applies an event without its amount. An
API that does not answer, or answers an error, fails the job, which RQ
retries and finally keeps in the dead-letter queue.
"""

from __future__ import annotations

import dataclasses
import json
import secrets as random
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any
from urllib.parse import quote

from payhook.errors import GatewayUnavailable, MalformedEvent
from payhook.gateways import api
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    NO_CONFIG,
    BodyHmacGateway,
    Config,
    Event,
    Reply,
    Sample,
    Setting,
    canonical_digest,
    check_printable,
    check_settings,
    hex_hmac_sha256,
    iso_time,
    load_json_object,
    meaning_digest,
    object_meaning,
    raw_digest,
    require_amount,
    require_currency,
    require_str,
)

#: Event types payhook acts on: `{resource_type}.{action}`.
TYPES = {
    "payments.confirmed": "succeeded",
    "payments.paid_out": "succeeded",
    "payments.failed": "failed",
    "payments.charged_back": "disputed",
    "refunds.refund_settled": "refunded",
}
#: The link naming each resource type's object, and the API path it is read at.
RESOURCES = {"payments": ("payment", "payments"), "refunds": ("refund", "refunds")}
#: The API version payhook reads resources in.
API_VERSION = "2015-07-06"
LIVE_API = "https://api.gocardless.com"
ACCEPTED = Reply(204, b"")


#: The `Webhook-Signature` of a body under a secret.
sign = hex_hmac_sha256


class GoCardlessGateway(BodyHmacGateway):
    name = "gocardless"
    signature_headers: tuple[str, ...] = ("webhook-signature",)
    hmac_header = "webhook-signature"
    settings: Mapping[str, Setting] = MappingProxyType(
        {
            "api_base_url": Setting(
                f"the GoCardless API the events' resources are read from (default {LIVE_API}; "
                "https://api-sandbox.gocardless.com for the sandbox)"
            ),
            "access_token": Setting(
                "a read-only access token of the GoCardless account", credential=True, required=True
            ),
        }
    )
    refused_status = 498
    #: GoCardless signs no timestamp.
    tolerance: float | None = None
    #: GoCardless retries a failed webhook for days, and an operator may
    #: resend one from its dashboard later.
    redelivery_window: float = 30 * DAY
    sample_type = "payments.confirmed"

    def generate_secret(self) -> str:
        """GoCardless shows the secret of a webhook endpoint it created; one
        made here is for tests and `payhook send`."""
        return random.token_urlsafe(32)

    def check_secret(self, secret: str) -> None:
        check_printable(secret, "a GoCardless webhook secret")

    def check_config(self, config: Config) -> None:
        check_settings(self.settings, config)
        api_base_url(config)

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return None  # one request carries several: the log line counts them

    def new_event_id(self) -> str:
        return "EV" + random.token_hex(7).upper()

    def split(self, body: bytes) -> list[bytes] | None:
        events = load_json_object(body).get("events")
        if not isinstance(events, list) or not events:
            raise MalformedEvent("events", "expected a non-empty list")
        return [
            json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode(
                "utf-8", "surrogatepass"
            )
            for event in events
        ]

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        """One event, as `split` made it; its amount comes with `complete`."""
        data = load_json_object(body)
        event_id = require_str(data, "id")
        resource_type = require_str(data, "resource_type")
        action = require_str(data, "action")
        assert event_id is not None and resource_type is not None and action is not None
        event_type = f"{resource_type}.{action}"
        occurred_at = iso_time(data.get("created_at"))
        digest = canonical_digest(data)
        links = data.get("links")
        links = links if isinstance(links, dict) else {}
        link = RESOURCES.get(resource_type, (resource_type.removesuffix("s"), ""))[0]
        kind = TYPES.get(event_type)
        if kind is None:
            linked = links.get(link)
            meaning = object_meaning(event_type, linked)
            return Event.ignored(event_id, event_type, occurred_at, digest, meaning=meaning)
        if occurred_at is None:
            raise MalformedEvent("created_at", "expected an ISO 8601 time")
        object_id = require_str(links, link)
        return Event(
            event_id=event_id,
            event_type=event_type,
            kind=kind,
            occurred_at=occurred_at,
            # Read from the API by `complete`, with the amount.
            gateway_order_id=None,
            merchant_reference=None,
            amount_minor=None,
            currency=None,
            digest=digest,
            # Until `complete`, the object is all the event says.
            meaning=object_meaning(event_type, object_id),
            links_to=object_id,
        )

    def complete(self, event: Event, config: Config, timeout: float) -> list[Event]:
        resource_type = event.event_type.split(".", 1)[0]
        path = RESOURCES[resource_type][1]
        object_id = event.links_to
        if object_id is None:
            raise MalformedEvent("links", "the event links to no object")
        resource = fetch_resource(config, path, object_id, timeout)
        if resource.get("id") != object_id:
            raise MalformedEvent(f"{path}.id", "the API answered another object")
        if resource_type == "payments":
            order_id: str | None = object_id
        else:
            links = resource.get("links")
            order_id = require_str(links if isinstance(links, dict) else {}, "payment")
        metadata = resource.get("metadata")
        completed = dataclasses.replace(
            event,
            gateway_order_id=order_id,
            merchant_reference=require_str(metadata, "order_id", optional=True, limit=MAX_REFERENCE)
            if isinstance(metadata, dict)
            else None,
            amount_minor=require_amount(resource, "amount"),
            currency=require_currency(resource, "currency"),
        )
        return [dataclasses.replace(completed, meaning=meaning_digest(completed), links_to=None)]

    def unreadable_digest(self, body: bytes) -> str:
        try:
            return canonical_digest(load_json_object(body))
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
        """A webhook of `samples`, one event each, as GoCardless posts it. A
        payment's event links the gateway order id; a refund's links a refund
        whose id is derived from the event's (the API must know both)."""
        events = []
        for sample in samples:
            resource_type, _, action = sample.event_type.partition(".")
            if resource_type == "refunds":
                links = {"refund": "RF" + sample.event_id.removeprefix("EV")}
            else:
                links = {"payment": sample.gateway_order_id}
            events.append(
                {
                    "id": sample.event_id,
                    "created_at": _iso(sample.occurred_at),
                    "resource_type": resource_type,
                    "action": action,
                    "links": links,
                    "details": {"origin": "gocardless", "cause": f"{resource_type[:-1]}_{action}"},
                    "metadata": {},
                    "resource_metadata": {},
                }
            )
        meta = {"webhook_id": "WB" + samples[0].event_id.removeprefix("EV")}
        body = json.dumps({"events": events, "meta": meta}, separators=(",", ":")).encode()
        return body, {"webhook-signature": sign(secret, body)}


def api_base_url(config: Config) -> str:
    """The endpoint's API; `ValueError` unless it is https (or a local fake's)."""
    return api.base_url(config, LIVE_API)


def fetch_resource(config: Config, path: str, object_id: str, timeout: float) -> dict[str, Any]:
    """`GET {api}/{path}/{id}`: the resource; `GatewayUnavailable` on any failure."""
    token = config.credentials.get("access_token")
    if not token:
        raise GatewayUnavailable(f"{path}: the endpoint has no access_token that opens")
    headers = {"authorization": f"Bearer {token}", "gocardless-version": API_VERSION}
    answer = api.get_json(
        config, LIVE_API, f"/{path}/{quote(object_id, safe='')}", headers, timeout
    )
    resource = answer.get(path) if isinstance(answer, dict) else None
    if not isinstance(resource, dict):
        raise GatewayUnavailable(f"GET /{path}/{object_id}: not a {path} resource")
    return resource


def _iso(seconds: int) -> str:
    return (
        datetime.fromtimestamp(seconds, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )
