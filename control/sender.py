"""`payhook send`: sign an event and POST it the way a gateway does.

The demo and debugging tool, like the Stripe CLI's `trigger`. With
`--copies N` the same signed request (same event id, timestamp and bytes) is
sent N times, `--concurrency C` at a time: a gateway's duplicate storm. Each
response is printed as one JSON line; the exit status is 0 when every copy
was accepted (2xx), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from payhook.errors import PayhookError
from payhook.gateways import get_gateway
from payhook.gateways.base import NO_CONFIG, Config, Sample
from payhook.settings import Settings

#: Seconds one request may take, connecting included.
REQUEST_TIMEOUT = 10.0


@dataclass(frozen=True)
class Event:
    """What to send, in payhook's terms; amounts in minor units."""

    gateway: str
    event_type: str
    gateway_order_id: str
    amount: int
    currency: str
    merchant_reference: str | None = None
    event_id: str | None = None
    #: When the event happened (Unix seconds), as its body says; None: a
    #: new event happens now, and a given event id at midnight UTC today.
    occurred_at: int | None = None
    #: Types of further events of the same order in the same request, for a
    #: gateway that batches (GoCardless, Adyen).
    also: tuple[str, ...] = ()


@dataclass(frozen=True)
class SignedRequest:
    event_id: str
    body: bytes
    headers: dict[str, str]
    #: When the event happened, as the body says (Unix seconds).
    occurred_at: int = 0


def sign_event(
    event: Event, secret: str, timestamp: int | None = None, config: Config = NO_CONFIG
) -> SignedRequest:
    """The body and headers a gateway would send for `event`, signed with
    `secret` as an endpoint of `config` is set up at the gateway: the
    gateway's module builds them (`Gateway.sample_request`)."""
    try:
        gateway = get_gateway(event.gateway)
    except ValueError as exc:
        raise PayhookError(f"--gateway: {exc}") from None
    timestamp = int(time.time()) if timestamp is None else timestamp
    occurred = _occurred_at(event, timestamp)
    first = event.event_id or gateway.new_event_id()
    samples = [
        Sample(
            # A given id sent again repeats the whole request, its batch too.
            event_id=first
            if n == 0
            else (f"{first}_{n}" if event.event_id else gateway.new_event_id()),
            event_type=event_type,
            gateway_order_id=event.gateway_order_id,
            amount=event.amount,
            currency=event.currency,
            merchant_reference=event.merchant_reference,
            occurred_at=occurred,
            repeated=event.event_id is not None,
        )
        for n, event_type in enumerate((event.event_type, *event.also))
    ]
    try:
        body, headers = gateway.sample_request(samples, secret, timestamp, config)
    except ValueError as exc:
        raise PayhookError(f"--gateway {gateway.name}: {exc}") from None
    headers.setdefault("content-type", "application/json")
    headers["user-agent"] = "payhook-send"
    return SignedRequest(first, body, headers, occurred)


def _iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _occurred_at(event: Event, now: int) -> int:
    """The body's time. Sending a given event id again must repeat its body,
    as a gateway's redelivery does (else payhook sees other content under
    the same id: a digest conflict), so by default such an event happened at
    midnight UTC of the day it is sent; each response line prints it, for
    `--occurred-at` on a later day."""
    if event.occurred_at is not None:
        return event.occurred_at
    return now - now % 86400 if event.event_id else now


async def send_copies(
    url: str,
    request: SignedRequest,
    copies: int,
    concurrency: int,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[dict[str, Any]]:
    """POST the same request `copies` times, `concurrency` at a time; one result per copy."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT, limits=limits, transport=transport
    ) as client:

        async def post(copy: int) -> dict[str, Any]:
            async with gate:
                started = time.perf_counter()
                try:
                    response = await client.post(url, content=request.body, headers=request.headers)
                except httpx.HTTPError as exc:
                    result: dict[str, Any] = {"error": f"{exc.__class__.__name__}: {exc}"}
                else:
                    result = {"status": response.status_code, "body": _body(response)}
                    if "retry-after" in response.headers:
                        result["retry_after"] = response.headers["retry-after"]
                elapsed = round((time.perf_counter() - started) * 1000, 1)
                line = (
                    {"copy": copy, "event_id": request.event_id}
                    | result
                    | {"ms": elapsed, "occurred_at": _iso(request.occurred_at)}
                )
                print(json.dumps(line), flush=True)
                return line

        return list(await asyncio.gather(*(post(n) for n in range(1, copies + 1))))


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def run(args: argparse.Namespace, settings: Settings) -> int:
    """`payhook send`; settings are unused: everything comes from the arguments."""
    if args.copies < 1:
        raise PayhookError("--copies must be at least 1")
    if args.concurrency < 1:
        raise PayhookError("--concurrency must be at least 1")
    if args.amount < 0:
        raise PayhookError("--amount must be a whole number of minor units, zero or more")
    try:
        url = httpx.URL(args.url)
    except httpx.InvalidURL as exc:
        raise PayhookError(f"--url: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise PayhookError("--url must be an http:// or https:// URL")
    if args.event_id is not None and not (args.event_id.isascii() and args.event_id.isprintable()):
        raise PayhookError("--event-id: printable ASCII only, as gateways send them")
    types = args.type or [get_gateway(args.gateway).sample_type]
    event = Event(
        gateway=args.gateway,
        event_type=types[0],
        also=tuple(types[1:]),
        gateway_order_id=args.gateway_order_id,
        amount=args.amount,
        currency=args.currency,
        merchant_reference=args.merchant_ref,
        event_id=args.event_id,
        occurred_at=_parse_occurred_at(args.occurred_at),
    )
    config = Config(
        named_values("--setting", args.setting or []),
        named_values("--credential", args.credential or []),
    )
    request = sign_event(event, args.secret, config=config)
    results = asyncio.run(send_copies(args.url, request, args.copies, args.concurrency))
    accepted = all(200 <= result.get("status", 0) < 300 for result in results)
    return 0 if accepted else 1


def _parse_occurred_at(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise PayhookError(f"--occurred-at: expected an ISO 8601 time, got {value!r}") from None
    if moment.tzinfo is None:
        raise PayhookError("--occurred-at: give a time zone, e.g. 2026-11-30T09:00:00Z")
    return int(moment.timestamp())


def named_values(option: str, given: list[str]) -> dict[str, str]:
    """`NAME=VALUE` arguments as a mapping; a VALUE of `-` is read from a
    line of standard input (a credential kept out of the shell's history),
    one of `@PATH` from that file (a PEM certificate)."""
    values: dict[str, str] = {}
    for item in given:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise PayhookError(f"{option}: expected NAME=VALUE, got {item!r}")
        if value == "-":
            value = sys.stdin.readline().rstrip("\n")
        elif value.startswith("@"):
            try:
                value = Path(value[1:]).read_text()
            except OSError as exc:
                raise PayhookError(f"{option} {name}: {exc}") from None
        values[name] = value
    return values
