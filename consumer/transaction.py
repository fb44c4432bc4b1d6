"""The one transaction that applies an authentic event, exactly once.

    1 insert the receipt (tenant_id, event_id) ON CONFLICT DO NOTHING
    2 it existed, live or archived: stop (a different digest is a security
      anomaly); its gateway timestamp is beyond the horizon: refuse it
    3 lock the mapped order FOR UPDATE
    4 compare identifiers, amount, currency and state
    5 one forward transition and its audit row
    6 the outbox row
    7 mark the receipt processed with its outcome; commit

The steps run on the server, in the function `payhook.apply_event_v2` and
its rules in `payhook.decide_v1` (`sql/migrations/0009_*.sql`): a job sends
one statement, which is its own transaction on the consumer's autocommit
connection, in one round trip, and the order's lock is never held across a
round trip to the worker. Locks are always taken receipt first, then order,
so two events never wait on each other in opposite orders.

Retention moves old receipts to an archive in transactions that delete the
live row and insert the archived one at once. The function reads the archive
in a statement after the insert, not inside it: an insert that waited for a
retention batch to commit runs on a snapshot from before that commit, the
next statement sees the archived identity.

The replay of an exception (`consumer.replay`) is the function beside it,
`payhook.replay_exception_v1` (`sql/migrations/0010_*.sql`): both decide with
`payhook.decide_v1` and write with `payhook.write_transition_v1`, and a
replay locks the exception first, then the receipt, then the order.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict, Unpack

import psycopg
import structlog
from psycopg.types.json import Jsonb

from payhook.db import Row, cancelled_if_interrupted
from payhook.endpoints import Endpoint
from payhook.gateways import Event
from payhook.horizon import DEFAULT_RECEIPT_RETENTION, beyond_horizon, receipt_horizon
from payhook.queries import query

log = structlog.get_logger(__name__)

#: SQLSTATEs retried inside the job: serialization_failure, deadlock_detected.
RETRYABLE = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)
#: Seconds of the first backoff after a retryable failure; doubles each time.
RETRY_BASE_DELAY = 0.02


@dataclass(frozen=True)
class Applied:
    """What the transaction did with one delivery."""

    outcome: str
    order_id: str | None = None
    exception_id: int | None = None
    retries: int = 0
    #: Applied, and events of the order wait as exceptions, arrived too early.
    parked: bool = False


class TooManyRetries(Exception):
    """The transaction kept failing with serialization failures or deadlocks."""

    def __init__(self, attempts: int, sqlstate: str | None) -> None:
        super().__init__(f"{attempts} attempts, last SQLSTATE {sqlstate}")
        self.attempts = attempts


class CallOptions(TypedDict, total=False):
    """How an event is recorded, beside what it is (see `apply_event`)."""

    forced_outcome: str | None
    forced_detail: dict[str, Any] | None
    horizon: datetime | None


def apply_with_retries(
    conn: psycopg.Connection[Row], call: dict[str, Any], *, retries: int
) -> Applied:
    """`apply_call`, retried on serialization failures and deadlocks with jittered backoff."""
    attempt = 0
    while True:
        try:
            result = apply_call(conn, call)
        except RETRYABLE as exc:
            attempt += 1
            log.warning(
                "transaction_retry",
                sqlstate=exc.sqlstate,
                attempt=attempt,
                event_id=call["event"].obj["event_id"],
            )
            if attempt > retries:
                # Not chained: the error's text may quote the event's content.
                raise TooManyRetries(attempt, exc.sqlstate) from None
            time.sleep(random.uniform(0, RETRY_BASE_DELAY * 2**attempt))
            continue
        return dataclasses.replace(result, retries=attempt)


def apply_event(
    conn: psycopg.Connection[Row],
    endpoint: Endpoint,
    event: Event,
    delivery_id: str,
    **options: Unpack[CallOptions],
) -> Applied:
    """Apply one authentic event in one transaction; safe to call any number of times.

    `forced_outcome` records the receipt with that outcome and changes nothing
    else (`ignored` for unknown types, `malformed` for unreadable bodies, whose
    exception records `forced_detail`).
    An event whose gateway timestamp is older than `horizon` (default: now
    minus the default receipt retention) is refused the same way, with the
    outcome `beyond_horizon` and an exception row. An event to act on
    without a timestamp is a bug of its gateway adapter, which refuses one
    as malformed: it raises `ValueError` and applies nothing.
    """
    return apply_call(conn, call_params(endpoint, event, delivery_id, **options))


def apply_call(conn: psycopg.Connection[Row], call: dict[str, Any]) -> Applied:
    """One `apply_event` statement (`call_params`), its own transaction on
    the consumer's autocommit connection."""
    with cancelled_if_interrupted(conn):
        row = conn.execute(query("apply_event"), call).fetchone()
    assert row is not None, "apply_event_v2 returns one row"
    return _applied(row)


def call_params(
    endpoint: Endpoint, event: Event, delivery_id: str, **options: Unpack[CallOptions]
) -> dict[str, Any]:
    """The parameters of one `apply_event` statement (see `apply_event`)."""
    forced_outcome = options.get("forced_outcome")
    forced_detail = options.get("forced_detail")
    if forced_outcome is None and event.kind is not None and event.occurred_at is None:
        raise ValueError(
            f"event {event.event_id!r} ({event.event_type}) has no gateway timestamp: "
            "the retention horizon cannot judge it"
        )
    horizon = options.get("horizon") or receipt_horizon(DEFAULT_RECEIPT_RETENTION)
    if forced_outcome is None and beyond_horizon(event.occurred_at, horizon):
        forced_outcome = "beyond_horizon"
        assert event.occurred_at is not None
        forced_detail = {
            "occurred_at": event.occurred_at.isoformat(),
            "horizon": horizon.isoformat(),
        }
    return {
        "tenant_id": endpoint.tenant_id,
        "endpoint_id": endpoint.id,
        "gateway": endpoint.gateway,
        "delivery_id": delivery_id,
        "event": Jsonb(event.to_json()),
        "forced_outcome": forced_outcome,
        "forced_detail": None if forced_detail is None else Jsonb(forced_detail),
    }


def apply_events(conn: psycopg.Connection[Row], calls: list[dict[str, Any]]) -> list[Applied]:
    """Apply several events (`call_params` each) in one transaction: one
    statement each, pipelined in one round trip, one commit, one WAL flush.

    Each event has its own outcome, exactly as if applied alone: a statement
    sees what the ones before it wrote (a second delivery of an event in the
    same batch is a duplicate). The statements run in the order of
    `lock_order`, so two batches take their locks in one order and do not
    wait on each other in a cycle. Any error rolls the whole transaction
    back and is raised: nothing of the batch is applied, and the caller
    applies its events one by one.
    """
    order = lock_order(calls)
    with cancelled_if_interrupted(conn), conn.pipeline():
        with conn.transaction():
            cursors = {i: conn.execute(query("apply_event"), calls[i]) for i in order}
        rows = {i: cursor.fetchone() for i, cursor in cursors.items()}
    applied = []
    for i in range(len(calls)):
        row = rows[i]
        assert row is not None, "apply_event_v2 returns one row"
        applied.append(_applied(row))
    return applied


def lock_order(calls: list[dict[str, Any]]) -> list[int]:
    """The order to run a batch's statements in (indexes into `calls`).

    Events naming the same order (sharing a merchant reference or a gateway
    order id, as the order's lookup does) keep the order they were queued
    in: a payment, then its refund, as one at a time would apply them.
    Those groups run sorted by tenant and by the gateway's order id (else
    the merchant reference), so that batches mostly lock orders in one
    global order. Where two batches still wait on each other (the same
    orders named differently, two deliveries of the same events queued in
    opposite orders), PostgreSQL detects the deadlock, and the batch it
    aborts applies its events one by one.
    """
    parent = list(range(len(calls)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    seen: dict[tuple[str, str, str], int] = {}
    keys = []
    for i, params in enumerate(calls):
        event, tenant = params["event"].obj, str(params["tenant_id"])
        reference, order = event.get("merchant_reference"), event.get("gateway_order_id")
        keys.append((tenant, order or reference or ""))
        for name, value in (("reference", reference), ("order", order)):
            if value:
                first = seen.setdefault((tenant, name, value), i)
                parent[root(i)] = root(first)
    group_key: dict[int, tuple[str, str]] = {}
    for i, key in enumerate(keys):
        group = root(i)
        group_key[group] = min(group_key.get(group, key), key)
    return sorted(range(len(calls)), key=lambda i: group_key[root(i)])


def _applied(row: Row) -> Applied:
    order_id = row["order_id"]
    return Applied(
        row["outcome"],
        None if order_id is None else str(order_id),
        row["exception_id"],
        parked=row["parked"],
    )
