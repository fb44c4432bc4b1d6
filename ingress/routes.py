"""The HTTP routes: the webhook receiver and the operational probes."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ingress.body import BodyTooLarge, ReadTimeout, read_body
from ingress.enqueue import EnqueueFailed
from ingress.ids import delivery_id
from payhook.endpoints import Endpoint
from payhook.envelope import Envelope, Part, part_proof
from payhook.errors import GatewayUnavailable, MalformedEvent, MalformedHeaders, SignatureError
from payhook.gateways import Gateway, get_gateway
from payhook.gateways.storable import storable_event_id

if TYPE_CHECKING:
    from ingress.app import Ingress

log = structlog.get_logger(__name__)

#: Why a signature check failed, for logs and metrics only: never in a response.
REASONS = {
    "MalformedHeaders": "malformed_headers",
    "SignatureMismatch": "signature_mismatch",
    "TimestampOutOfTolerance": "timestamp_out_of_tolerance",
    "UntrustedCertificate": "untrusted_certificate",
}
JSON = "application/json"
CLOSE = ((b"connection", b"close"),)
#: Events one request may carry: GoCardless sends up to a few hundred, Adyen
#: fewer. More, from an authentic sender, is refused whole (413) rather than
#: written as that many jobs in one script.
MAX_EVENTS = 1000
#: Fault point for tests: SIGKILL this process once a job is queued, before answering.
FAULT_KILL_AFTER_ENQUEUE = "ingress_kill_after_enqueue"


class Answer(NamedTuple):
    """A webhook response: status, body and headers beyond the content ones."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes = b"application/json"


def _error(status: int, error: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Answer:
    return Answer(status, json.dumps({"error": error}).encode(), headers)


#: Where gateways post: `WEBHOOK_PREFIX + endpoint_id`.
WEBHOOK_PREFIX = "/webhooks/"


async def receive_webhook(scope: Scope, receive: Receive, send: Send) -> None:
    """`POST /webhooks/{endpoint_id}`: authenticate, enqueue, acknowledge.

    A plain ASGI app, not a request-response function: on the hottest path
    Starlette's `Request` and `Response` objects and the exception wrapper
    around them cost 10% of a request's CPU (437 µs per request with them,
    392 without, measured under wrk side by side). `ingress.app.IngressApp`
    calls it without Starlette's middleware and router, so an unexpected
    error is answered here, as Starlette's outermost middleware would: a 500,
    and the error raised on for the server to log.
    """
    ingress: Ingress = scope["app"].state.ingress
    started = time.perf_counter()
    line: dict[str, Any] = {"endpoint_id": None, "gateway": None}
    try:
        answer = await _receive(ingress, scope, receive, line)
    except Exception:
        await _answer(ingress, send, _error(500, "internal_error"), line, started)
        raise
    await _answer(ingress, send, answer, line, started)


class _AsgiEndpoint:
    """An ASGI function as a route endpoint: Starlette calls a plain function
    with a `Request`, an object with the ASGI triple."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


async def _answer(
    ingress: Ingress, send: Send, answer: Answer, line: dict[str, Any], started: float
) -> None:
    line["duration_ms"] = round((time.perf_counter() - started) * 1000, 2)
    ingress.metrics.count_request(line["gateway"] or "none", answer.status)
    log.info("webhook_received", status=answer.status, **line)
    content_type = (b"content-type", answer.content_type)
    headers = [(b"content-length", b"%d" % len(answer.body)), content_type, *answer.headers]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


async def _receive(
    ingress: Ingress, scope: Scope, receive: Receive, line: dict[str, Any]
) -> Answer:
    # Cached ids are canonical UUIDs: most requests hit without parsing one.
    raw_id = scope["path_params"]["endpoint_id"]
    endpoint = ingress.cache.get(raw_id) or ingress.cache.get(_canonical(raw_id) or "")
    if endpoint is None:
        line["endpoint_id"] = _canonical(raw_id)
        if not ingress.cache.loaded:
            line["reason"] = "endpoints_not_loaded"
            return _error(503, "unavailable", ingress.retry_after)
        line["reason"] = "unknown_endpoint"
        return _error(404, "not_found")
    line["endpoint_id"] = endpoint.id
    line["tenant_id"] = endpoint.tenant_id
    line["gateway"] = endpoint.gateway
    try:
        body = await read_body(
            scope, receive, ingress.settings.max_body, ingress.config.read_timeout
        )
    except BodyTooLarge:
        line["reason"] = "body_too_large"
        # Close the connection: whatever the sender still streams is never read.
        return _error(413, "payload_too_large", CLOSE)
    except ReadTimeout:
        line["reason"] = "read_timeout"
        return _error(408, "request_timeout", CLOSE)
    except ClientDisconnect:
        line["reason"] = "client_disconnected"
        return _error(400, "bad_request")
    line["bytes"] = len(body)

    gateway = get_gateway(endpoint.gateway)
    headers = _signature_headers(scope, gateway.signature_headers)
    try:
        fetch = gateway.fetcher(headers, endpoint.config)
        if fetch is not None:
            # What verifying needs from the gateway (a certificate), once; in
            # a thread, so the event loop serves other requests meanwhile.
            await asyncio.to_thread(fetch, ingress.settings.gateway_timeout)
        gateway.verify(
            headers,
            body,
            endpoint.secrets,
            now=time.time(),
            tolerance=gateway.tolerance,
            config=endpoint.config,
        )
    except SignatureError as exc:
        reason = REASONS.get(exc.__class__.__name__, "signature_invalid")
        line["reason"] = reason
        ingress.metrics.signature_failures.labels(gateway.name, reason).inc()
        if isinstance(exc, MalformedHeaders):
            return _error(400, "bad_request")
        return _error(gateway.refused_status, "unauthorized")
    except GatewayUnavailable as exc:
        # Not the sender's fault: it retries, by then the gateway may answer.
        line["reason"] = "gateway_unavailable"
        line["error"] = str(exc)
        return _error(503, "unavailable", ingress.retry_after)

    # Authentic from here on. A body payhook cannot read is queued all the
    # same: the consumer records it. Only the signature headers travel.
    try:
        parts = gateway.split(body)
    except MalformedEvent:
        parts = None  # recorded whole, as an event that cannot be read
    if parts is not None and len(parts) > MAX_EVENTS:
        line["reason"] = "too_many_events"
        line["events"] = len(parts)
        return _error(413, "too_many_events")
    envelopes = _envelopes(endpoint, headers, body, parts)
    if len(envelopes) == 1 and envelopes[0].part is None:
        line["event_id"] = read_event_id(gateway, headers, body)
    else:
        line["events"] = len(envelopes)
    line["delivery_id"] = (
        envelopes[0].part.request_id if envelopes[0].part else envelopes[0].delivery_id
    )
    try:
        seconds = await ingress.enqueuer.enqueue(envelopes)
    except EnqueueFailed as exc:
        line["reason"] = "enqueue_failed"
        line["error"] = str(exc)
        return _error(503, "unavailable", ingress.retry_after)
    ingress.metrics.enqueue_seconds.observe(seconds)
    if FAULT_KILL_AFTER_ENQUEUE in ingress.settings.faults:
        log.warning("fault_kill_after_enqueue", **line)
        os.kill(os.getpid(), signal.SIGKILL)
    reply = gateway.accepted([envelope.delivery_id for envelope in envelopes])
    return Answer(reply.status, reply.body, content_type=reply.content_type)


def _envelopes(
    endpoint: Endpoint, headers: dict[str, str], body: bytes, parts: list[bytes] | None
) -> list[Envelope]:
    """The jobs of an authentic request: one, or one per event of a batch
    (`parts`), each with its proof (`payhook.envelope.part_proof`)."""
    received_at = datetime.now(UTC)
    if parts is None:
        return [Envelope(endpoint.id, body, headers, received_at, delivery_id())]
    request_id, count, secret = delivery_id(), len(parts), endpoint.secrets[0]
    return [
        Envelope(
            endpoint_id=endpoint.id,
            body=part,
            headers={},
            received_at=received_at,
            delivery_id=delivery_id(),
            part=Part(
                request_id,
                index,
                count,
                part_proof(secret, endpoint.id, request_id, index, count, part),
            ),
        )
        for index, part in enumerate(parts)
    ]


def _canonical(endpoint_id: str) -> str | None:
    try:
        return str(uuid.UUID(endpoint_id))
    except ValueError:
        return None


@functools.cache
def _encoded(names: tuple[str, ...]) -> frozenset[bytes]:
    return frozenset(name.encode("latin-1") for name in names)


def _signature_headers(scope: Scope, names: tuple[str, ...]) -> dict[str, str]:
    """The request's `names` headers, the first of repeats; ASGI gives names lower-case."""
    wanted = _encoded(names)
    headers: dict[str, str] = {}
    for name, value in scope["headers"]:
        if name in wanted:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return headers


def read_event_id(gateway: Gateway, headers: dict[str, str], body: bytes) -> str | None:
    """The event id of an authentic request, for the log line, as the consumer
    stores it (bounded, no NUL or lone surrogate); None if unreadable."""
    value = gateway.read_event_id(headers, body)
    return None if value is None else storable_event_id(value)


async def healthz(request: Request) -> Response:
    """The process is alive and its event loop answers."""
    return Response(b'{"status": "ok"}', media_type=JSON)


async def readyz(request: Request) -> Response:
    """Ready to accept events: Redis answers and the endpoint cache is loaded."""
    ingress: Ingress = request.app.state.ingress
    checks = {"redis": await ingress.enqueuer.ping(), "endpoints": ingress.cache.loaded}
    ready = all(checks.values())
    body = {"status": "ready" if ready else "not_ready"} | checks
    return Response(json.dumps(body).encode(), status_code=200 if ready else 503, media_type=JSON)


async def metrics(request: Request) -> Response:
    """Prometheus text; the queue depth and cache age are read now."""
    ingress: Ingress = request.app.state.ingress
    depth = await ingress.enqueuer.depth()
    age = ingress.cache.age()
    ingress.metrics.queue_depth.set(float("nan") if depth is None else depth)
    ingress.metrics.endpoints_age.set(float("nan") if age is None else age)
    ingress.metrics.endpoints.set(len(ingress.cache))
    return Response(ingress.metrics.render(), media_type=CONTENT_TYPE_LATEST)


ROUTES = [
    # Reached for what `IngressApp` leaves to Starlette: another method (405),
    # or a POST under a root path (`--root-path`), which Starlette strips.
    Route(WEBHOOK_PREFIX + "{endpoint_id}", _AsgiEndpoint(receive_webhook), methods=["POST"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
