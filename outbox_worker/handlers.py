"""Delivery handlers: what performing one outbox row's side effect means.

`http`: POST a JSON body to the tenant's fulfilment URL with an
`Idempotency-Key` and a Standard Webhooks signature made with the tenant's
signing secret, where the client lets it go (`outbox_worker.egress`).
`log`: the tenant has no URL; the effect is a log line.

A handler never touches the database; it answers with an `Outcome` and the
loop records it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import structlog

from outbox_worker.backoff import parse_retry_after
from outbox_worker.claims import Claim
from payhook.destinations import DestinationRefused
from payhook.gateways import standard

log = structlog.get_logger(__name__)

#: The `User-Agent` of every delivery.
USER_AGENT = "payhook-outbox/1"
#: 4xx statuses that mean "later", not "never": a request timeout, too many
#: requests, too early, and 409, which receivers that deduplicate by
#: `Idempotency-Key` answer while an earlier attempt with the same key is still
#: in progress (the IETF idempotency-key draft, Stripe): the attempt that
#: timed out here may yet succeed there.
RETRYABLE_4XX = frozenset({408, 409, 425, 429})
#: Bytes of a response body read to keep the connection alive; the body is never used.
MAX_DRAINED_BODY = 64 * 1024
#: Seconds spent reading that body at most (checked between chunks).
MAX_DRAIN_SECONDS = 1.0
#: Body fields that identify the side effect; always present.
IDENTITY_FIELDS = ("action", "tenant_id", "order_id", "merchant_reference", "event_id")

Kind = Literal["delivered", "retry", "dead"]


@dataclass(frozen=True)
class Outcome:
    """What one attempt came to. `error` is short and carries no secret or payload."""

    kind: Kind
    handler: str
    status: int | None = None
    error: str | None = None
    #: Seconds the receiver asked us to wait (`Retry-After`).
    retry_after: float | None = None


def deliver(client: httpx.Client, claim: Claim) -> Outcome:
    """Perform the row's side effect with the handler its tenant calls for."""
    if claim.secret_error is not None:
        # Retried: the row delivers once the key that opens the secret is configured.
        return Outcome("retry", "none", error=f"tenant signing secret: {claim.secret_error}")
    if claim.signing_secret is None:
        return Outcome("dead", "none", error="tenant not found")
    if claim.fulfilment_url is None:
        return log_delivery(claim)
    return post_delivery(client, claim)


def log_delivery(claim: Claim) -> Outcome:
    """The `log` handler: one line naming the effect, never the payload."""
    log.info(
        "outbox_logged",
        action=claim.action,
        order_id=claim.order_id,
        idempotency_key=claim.idempotency_key,
    )
    return Outcome("delivered", "log")


def post_delivery(client: httpx.Client, claim: Claim, *, now: float | None = None) -> Outcome:
    """The `http` handler: one signed POST; only the status and `Retry-After` matter."""
    assert claim.fulfilment_url is not None and claim.signing_secret is not None
    timestamp = int(time.time() if now is None else now)
    body = delivery_body(claim)
    headers = delivery_headers(claim, body, timestamp)
    try:
        with client.stream("POST", claim.fulfilment_url, content=body, headers=headers) as resp:
            outcome = classify(resp.status_code, resp.headers.get("retry-after"), time.time())
            _drain(resp)
            return outcome
    except DestinationRefused as exc:
        # Nothing was sent. Trying again cannot help until an operator changes
        # the tenant's URL or the allowed networks; `payhook outbox retry` then.
        return Outcome("dead", "http", error=f"destination refused: {exc}")
    except (httpx.InvalidURL, httpx.UnsupportedProtocol, UnicodeError):
        # UnicodeError: a host name no resolver can take (a label over 63
        # characters, an empty or invalid IDNA label), found when connecting.
        # The message would repeat the URL, which may carry credentials.
        return Outcome("dead", "http", error="fulfilment URL is not a usable http(s) URL")
    except httpx.TimeoutException as exc:
        return Outcome("retry", "http", error=f"timeout: {type(exc).__name__}")
    except httpx.TransportError as exc:
        return Outcome("retry", "http", error=f"connection error: {type(exc).__name__}: {exc}")


def _drain(response: httpx.Response) -> None:
    """Read a small, prompt body so the connection can be reused; give up on anything else.

    The status is already decided: a failure here only costs the connection.
    """
    if response.is_stream_consumed:
        return
    size, deadline = 0, time.monotonic() + MAX_DRAIN_SECONDS
    try:
        for chunk in response.iter_raw():
            size += len(chunk)
            if size > MAX_DRAINED_BODY or time.monotonic() > deadline:
                return  # closing an unread response closes its connection
    except httpx.TransportError:
        return


def classify(status: int, retry_after: str | None, now: float) -> Outcome:
    """2xx delivered; 408, 409, 425, 429 and 5xx later; any other 4xx never; anything else later."""
    if 200 <= status < 300:
        return Outcome("delivered", "http", status=status)
    error = f"HTTP {status}"
    if 400 <= status < 500 and status not in RETRYABLE_4XX:
        return Outcome("dead", "http", status=status, error=error)
    return Outcome(
        "retry", "http", status=status, error=error, retry_after=parse_retry_after(retry_after, now)
    )


def delivery_body(claim: Claim) -> bytes:
    """The stored payload, with the identity fields guaranteed, as compact sorted JSON."""
    body: dict[str, Any] = dict(claim.payload)
    body.update(
        action=claim.action,
        tenant_id=claim.tenant_id,
        order_id=claim.order_id,
        event_id=claim.event_id,
        merchant_reference=claim.payload.get("merchant_reference"),
    )
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def delivery_headers(claim: Claim, body: bytes, timestamp: int) -> dict[str, str]:
    """`Idempotency-Key` and the Standard Webhooks headers.

    `webhook-id` is the outbox row id: stable across attempts, as the Standard
    Webhooks specification asks; the timestamp and signature are fresh on each.
    """
    assert claim.signing_secret is not None
    message_id = f"msg_{claim.id.replace('-', '')}"
    return {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "idempotency-key": claim.idempotency_key,
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": standard.sign(claim.signing_secret, message_id, timestamp, body),
    }
