"""One job: re-establish authenticity, then apply the event in one transaction."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import psycopg
import structlog
from redis import Redis

from consumer.endpoints import EndpointCache
from consumer.replay import replay_parked
from consumer.transaction import (
    Applied,
    TooManyRetries,
    apply_events,
    apply_with_retries,
    call_params,
)
from payhook import counters
from payhook.db import Pool, Row, error_summary, execute, pooled_connection, tenant_transaction
from payhook.endpoints import Endpoint
from payhook.envelope import Envelope, MalformedJob, NewerEnvelope, part_proven
from payhook.errors import DatabaseError, MalformedEvent, SignatureError, SignatureMismatch
from payhook.flow import RECEIPT_TO_COMMIT, FlowRecorder
from payhook.gateways import Event, Gateway, get_gateway
from payhook.gateways.base import raw_digest
from payhook.gateways.storable import (
    recorded_identity,
    storable_event,
    storable_event_id,
    storable_type,
    unreadable_event_id,
)
from payhook.horizon import receipt_horizon
from payhook.sealing import Keyring
from payhook.settings import Settings

log = structlog.get_logger(__name__)

#: How far the ingress's clock may be from the database's, for secret retirement.
CLOCK_SKEW = timedelta(seconds=30)


@dataclass
class Runtime:
    """What a job needs, built once per worker process."""

    settings: Settings
    pool: Pool
    #: Where transaction retries are counted for alerts; None in unit tests.
    redis: Redis | None = None
    #: Endpoints, their secrets opened with the settings' keys.
    endpoints: EndpointCache = field(init=False)
    #: Receipt-to-commit times, added to Redis for `/metrics` (`payhook.flow`).
    flow: FlowRecorder = field(init=False)

    def __post_init__(self) -> None:
        self.endpoints = EndpointCache(Keyring.from_settings(self.settings))
        self.flow = FlowRecorder(RECEIPT_TO_COMMIT)


@dataclass
class Prepared:
    """An authentic job's event(s), read and ready for their transaction."""

    gateway: Gateway
    endpoint: Endpoint
    envelope: Envelope
    #: The event, or the events the gateway's API says it stands for.
    events: list[tuple[Event, MalformedEvent | None]]
    #: The job's log context (delivery, endpoint, tenant, event).
    context: dict[str, Any]


def handle(runtime: Runtime, data: object) -> Applied:
    """Apply one job's envelope; every path ends in an outcome or an exception for RQ."""
    result = handle_many(runtime, [data])[0]
    if isinstance(result, BaseException):
        raise result
    return result


def handle_many(runtime: Runtime, jobs: Sequence[object]) -> list[Applied | Exception]:
    """Apply several jobs' envelopes: each job's outcome, or the exception
    its job raises to RQ, in the order of `jobs`; one log line per job.

    Each job is authenticated and read on its own, as `handle` does; the
    events then commit together, in one transaction (`apply_events`), and
    should that transaction fail, each event in one of its own, retried as
    `handle` retries. An event the gateway's API completes into several
    is applied alone, each of those in a transaction of its own.
    PostgreSQL's errors leave as their class and SQLSTATE (`DatabaseError`):
    their text may quote the event, in RQ's failure info and logs.
    """
    results: list[Applied | Exception | None] = [None] * len(jobs)
    with pooled_connection(runtime.pool) as conn:
        together: list[tuple[int, Prepared, dict[str, Any]]] = []
        for i, data in enumerate(jobs):
            structlog.contextvars.clear_contextvars()
            try:
                prepared = _prepare(runtime, conn, data)
                if isinstance(prepared, Applied):
                    results[i] = _done(prepared)
                elif len(prepared.events) == 1:
                    event, malformed = prepared.events[0]
                    together.append((i, prepared, _params(runtime, prepared, event, malformed)))
                else:
                    results[i] = _done(_apply_each(runtime, conn, prepared))
            except Exception as exc:
                results[i] = _failed(exc)
        for i, result in _apply_together(runtime, conn, together):
            results[i] = result
    structlog.contextvars.clear_contextvars()
    runtime.flow.flush_due(runtime.redis)
    assert all(result is not None for result in results), "every job has its outcome"
    return cast(list[Applied | Exception], results)


def _prepare(runtime: Runtime, conn: psycopg.Connection[Row], data: object) -> Applied | Prepared:
    """Authenticate and read one job's envelope: its final outcome (an anomaly,
    refused), or its events, ready to apply. Binds the job's log context."""
    try:
        envelope = Envelope.from_json(data)
    except NewerEnvelope as exc:
        # Raised to RQ: retried, then kept in the dead-letter queue until the
        # consumers are upgraded and it is requeued.
        log.error("envelope_too_new", version=exc.version)
        raise
    except MalformedJob:
        _anomaly(runtime, "malformed_job", conn=conn)
        log.error("job_malformed")
        return Applied("malformed_job")
    structlog.contextvars.bind_contextvars(
        delivery_id=envelope.delivery_id, endpoint_id=envelope.endpoint_id
    )
    endpoint, fresh = runtime.endpoints.get(conn, envelope.endpoint_id)
    if endpoint is None:
        _anomaly(runtime, "unknown_endpoint", conn=conn, envelope=envelope)
        log.error("endpoint_unknown")
        return Applied("unknown_endpoint")
    structlog.contextvars.bind_contextvars(tenant_id=endpoint.tenant_id)
    gateway = get_gateway(endpoint.gateway)
    try:
        _verify(runtime, gateway, envelope, endpoint)
    except SignatureError:
        if not fresh:  # perhaps signed with a secret rotated in since we cached
            endpoint, _ = runtime.endpoints.get(conn, envelope.endpoint_id, fresh=True)
        try:
            if endpoint is None:
                raise SignatureMismatch() from None
            _verify(runtime, gateway, envelope, endpoint)
        except SignatureError as exc:
            _anomaly(runtime, "signature_invalid", conn=conn, envelope=envelope, endpoint=endpoint)
            log.error("job_signature_invalid", reason=exc.__class__.__name__)
            return Applied("signature_invalid")
    event, malformed = _read_event(gateway, envelope)
    structlog.contextvars.bind_contextvars(event_id=event.event_id)
    events = [(event, malformed)]
    if malformed is not None:
        log.error("event_malformed", field=malformed.field, reason=malformed.reason)
    elif event.links_to is not None:
        # What the event only links to, from the gateway's API, before any
        # transaction; GatewayUnavailable goes to RQ: the job is retried.
        # Each event it stands for is applied in a transaction of its own,
        # keyed by its own id: a retry after a crash between them applies
        # the rest and finds the first a duplicate.
        events = _completed(runtime, gateway, endpoint, event)
    context = structlog.contextvars.get_contextvars()
    return Prepared(gateway, endpoint, envelope, events, context)


def _apply_each(runtime: Runtime, conn: psycopg.Connection[Row], prepared: Prepared) -> Applied:
    """The events of one job, each in a transaction of its own: the last outcome."""
    for event, malformed in prepared.events:
        structlog.contextvars.bind_contextvars(event_id=event.event_id)
        result = _apply(runtime, conn, prepared, _params(runtime, prepared, event, malformed))
    return result


def _apply_together(
    runtime: Runtime,
    conn: psycopg.Connection[Row],
    together: list[tuple[int, Prepared, dict[str, Any]]],
) -> list[tuple[int, Applied | Exception]]:
    """The events of several jobs in one transaction; alone, or should that
    transaction fail, each in one of its own.

    Not when it was cancelled (the batch's job timeout, or the statement
    timeout): one by one, the event that waited would wait again. Each job
    then fails with the cancellation, and RQ retries it.
    """
    if len(together) > 1:
        try:
            applied = apply_events(conn, [params for _, _, params in together])
        except psycopg.errors.QueryCanceled as exc:
            return [(i, _failed(exc)) for i, _, _ in together]
        except psycopg.Error as exc:
            structlog.contextvars.clear_contextvars()
            log.warning("batch_applied_one_by_one", events=len(together), sqlstate=exc.sqlstate)
        else:
            committed = [
                (i, prepared, result)
                for (i, prepared, _), result in zip(together, applied, strict=True)
            ]
            return _each(
                committed, lambda prepared, result: _after(runtime, conn, prepared, result)
            )
    return _each(together, lambda prepared, call: _apply(runtime, conn, prepared, call))


def _each(
    jobs: list[tuple[int, Prepared, Any]], step: Callable[[Prepared, Any], Applied]
) -> list[tuple[int, Applied | Exception]]:
    """`step` for each job, under its log context: its outcome, logged, or
    the exception its job raises."""
    results: list[tuple[int, Applied | Exception]] = []
    for i, prepared, given in jobs:
        _bind(prepared.context)
        try:
            results.append((i, _done(step(prepared, given))))
        except Exception as exc:
            results.append((i, _failed(exc)))
    return results


def _params(
    runtime: Runtime, prepared: Prepared, event: Event, malformed: MalformedEvent | None
) -> dict[str, Any]:
    return call_params(
        prepared.endpoint,
        event,
        prepared.envelope.delivery_id,
        forced_outcome=None if malformed is None else "malformed",
        forced_detail=None if malformed is None else malformed.detail,
        horizon=receipt_horizon(runtime.settings.receipt_retention),
    )


def _bind(context: dict[str, Any]) -> None:
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)


def _done(result: Applied) -> Applied:
    """One job's outcome, logged: its one canonical line."""
    log.info("event_applied", outcome=result.outcome, retries=result.retries)
    return result


def _failed(exc: Exception) -> Exception:
    """The exception a job raises to RQ; PostgreSQL's as class and SQLSTATE only."""
    if isinstance(exc, psycopg.Error):
        return DatabaseError(error_summary(exc))
    return exc


def _apply(
    runtime: Runtime, conn: psycopg.Connection[Row], prepared: Prepared, call: dict[str, Any]
) -> Applied:
    """One event (`call`) in a transaction of its own, retried as configured."""
    try:
        result = apply_with_retries(conn, call, retries=runtime.settings.serialization_retries)
    except TooManyRetries as exc:
        _count_retries(runtime, exc.attempts)
        raise
    return _after(runtime, conn, prepared, result)


def _after(
    runtime: Runtime, conn: psycopg.Connection[Row], prepared: Prepared, result: Applied
) -> Applied:
    """Once an event's transaction committed: its retries counted, the
    events that waited for it replayed, its time from receipt to commit."""
    _count_retries(runtime, result.retries)
    if result.parked and result.order_id is not None:
        replay_parked(conn, prepared.endpoint.tenant_id, result.order_id)
    if result.outcome != "duplicate":
        waited = time.time() - prepared.envelope.received_at.timestamp()
        runtime.flow.observe(prepared.gateway.name, waited)
    return result


def _count_retries(runtime: Runtime, retries: int) -> None:
    if retries and runtime.redis is not None:
        counters.record(runtime.redis, counters.SERIALIZATION_RETRIES, retries)


def _verify(runtime: Runtime, gateway: Gateway, envelope: Envelope, endpoint: Endpoint) -> None:
    # Freshness was the ingress's check; a retried job may be hours old. A
    # secret retired just before the job was received may still have been in
    # the ingress's cache, which refreshes every PAYHOOK_ENDPOINT_REFRESH.
    grace = timedelta(seconds=runtime.settings.endpoint_refresh) + CLOCK_SKEW
    secrets = endpoint.secrets_at(envelope.received_at, grace)
    if envelope.part is not None:
        # One event of a batch: the gateway signed the request, which the job
        # does not carry; the ingress's proof stands for that signature.
        if not part_proven(envelope, secrets):
            raise SignatureMismatch()
        return
    fetch = gateway.fetcher(envelope.headers, endpoint.config)
    if fetch is not None:
        fetch(runtime.settings.gateway_timeout)
    gateway.verify(
        envelope.headers,
        envelope.body,
        secrets,
        now=None,
        tolerance=None,
        config=endpoint.config,
    )


def _completed(
    runtime: Runtime, gateway: Gateway, endpoint: Endpoint, event: Event
) -> list[tuple[Event, MalformedEvent | None]]:
    """The events the gateway's API says `event` stands for, stored as any
    event is; what the API answered may be malformed too, and then `event`
    is recorded as malformed."""
    try:
        completed = gateway.complete(event, endpoint.config, runtime.settings.gateway_timeout)
        return [(storable_event(e), None) for e in completed]
    except MalformedEvent as exc:
        log.error("event_malformed", field=exc.field, reason=exc.reason)
        return [(event, exc)]


def _read_event(gateway: Gateway, envelope: Envelope) -> tuple[Event, MalformedEvent | None]:
    """The event as it is stored; for one that cannot be read or stored, what
    is recorded of it and why."""
    parsed = None
    try:
        parsed = gateway.parse(envelope.headers, envelope.body)
        return storable_event(parsed), None
    except MalformedEvent as exc:
        if parsed is not None:
            # Its digest, not the body's: were it storable later (a time no
            # longer in the future), its redelivery is a duplicate, not a conflict.
            return recorded_identity(parsed), exc
        return _unreadable(gateway, envelope), exc


def _unreadable(gateway: Gateway, envelope: Envelope) -> Event:
    """An authentic body we cannot read, as an event that can only be recorded:
    under its id if one can be read, else under its digest, never the
    delivery's, so that every delivery of it is one receipt."""
    event_id = envelope.headers.get("webhook-id")
    event_type = None
    try:
        data: Any = json.loads(envelope.body)
        if isinstance(data, dict):
            event_id = event_id or (data.get("id") if isinstance(data.get("id"), str) else None)
            event_type = data.get("type")
    except (ValueError, RecursionError):
        pass
    digest = gateway.unreadable_digest(envelope.body)
    return Event.unreadable(
        storable_event_id(event_id) if event_id else unreadable_event_id(digest),
        storable_type(event_type),
        digest,
    )


def _anomaly(
    runtime: Runtime,
    kind: str,
    *,
    conn: psycopg.Connection[Row] | None = None,
    envelope: Envelope | None = None,
    endpoint: Endpoint | None = None,
) -> None:
    params = {
        "tenant_id": endpoint.tenant_id if endpoint else None,
        "event_id": None,
        "endpoint_id": envelope.endpoint_id if envelope else None,
        "delivery_id": envelope.delivery_id if envelope else None,
        "kind": kind,
        "stored_sha256": None,
        "received_sha256": raw_digest(envelope.body) if envelope else None,
    }
    tenant_id = params["tenant_id"]
    if conn is not None:
        with tenant_transaction(conn, tenant_id):
            execute(conn, "insert_anomaly", params)
        return
    with pooled_connection(runtime.pool) as own, tenant_transaction(own, tenant_id):
        execute(own, "insert_anomaly", params)
