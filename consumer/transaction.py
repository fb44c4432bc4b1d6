"""The one transaction that applies an authentic event, exactly once.

    1 insert the receipt (tenant_id, event_id) ON CONFLICT DO NOTHING
    2 it existed, live or archived: stop (a different digest is a security
      anomaly); its gateway timestamp is beyond the horizon: refuse it
    3 lock the mapped order FOR UPDATE
    4 compare identifiers, amount, currency and state   (consumer.rules)
    5 one forward transition and its audit row
    6 the outbox row
    7 mark the receipt processed with its outcome; commit

Locks are always taken receipt first, then order, so two events never wait
on each other in opposite orders. Steps 2 and 3 are one statement, and so are
5 to 7 (`sql/queries/consumer.sql`): a first delivery is BEGIN and three
statements, in two round trips.

Retention moves old receipts to an archive in transactions that delete the
live row and insert the archived one at once. The archive is read by a
statement after the insert, not inside it: an insert that waited for a
retention batch to commit runs on a snapshot from before that commit, the
next statement sees the archived identity.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
import structlog
from psycopg.types.json import Jsonb

from consumer.rules import EXCEPTION_OUTCOMES, Decision, Order, decide
from payhook.db import Row, execute, fetch_one, pipelined_transaction
from payhook.gateways import Event
from payhook.horizon import DEFAULT_RECEIPT_RETENTION, beyond_horizon, receipt_horizon
from payhook.queries import query

log = structlog.get_logger(__name__)

#: SQLSTATEs retried inside the job: serialization_failure, deadlock_detected.
RETRYABLE = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)
#: Seconds of the first backoff after a retryable failure; doubles each time.
RETRY_BASE_DELAY = 0.02


@dataclass(frozen=True)
class Endpoint:
    id: str
    tenant_id: str
    gateway: str
    secrets: tuple[str, ...]
    #: Retired secrets and when each was retired.
    retired: tuple[tuple[str, datetime], ...] = ()

    def secrets_at(self, received_at: datetime, grace: timedelta) -> tuple[str, ...]:
        """The secrets that may have verified at the ingress when a job was
        received: the active ones, and those retired since or less than
        `grace` before (the ingress's endpoint cache lags the database, and
        `received_at` is the ingress's clock, `retired_at` the database's)."""
        since = received_at - grace
        return self.secrets + tuple(s for s, retired_at in self.retired if retired_at > since)


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


def apply_with_retries(
    conn: psycopg.Connection[Row],
    endpoint: Endpoint,
    event: Event,
    delivery_id: str,
    *,
    retries: int,
    forced_outcome: str | None = None,
    horizon: datetime | None = None,
) -> Applied:
    """`apply_event`, retried on serialization failures and deadlocks with jittered backoff."""
    attempt = 0
    while True:
        try:
            result = apply_event(
                conn, endpoint, event, delivery_id, forced_outcome=forced_outcome, horizon=horizon
            )
        except RETRYABLE as exc:
            attempt += 1
            log.warning(
                "transaction_retry",
                sqlstate=exc.sqlstate,
                attempt=attempt,
                event_id=event.event_id,
            )
            if attempt > retries:
                raise TooManyRetries(attempt, exc.sqlstate) from exc
            time.sleep(random.uniform(0, RETRY_BASE_DELAY * 2**attempt))
            continue
        return dataclasses.replace(result, retries=attempt)


def apply_event(
    conn: psycopg.Connection[Row],
    endpoint: Endpoint,
    event: Event,
    delivery_id: str,
    *,
    forced_outcome: str | None = None,
    horizon: datetime | None = None,
) -> Applied:
    """Apply one authentic event in one transaction; safe to call any number of times.

    `forced_outcome` records the receipt with that outcome and changes nothing
    else (`ignored` for unknown types, `malformed` for unreadable bodies).
    An event whose gateway timestamp is older than `horizon` (default: now
    minus the default receipt retention) is refused the same way, with the
    outcome `beyond_horizon` and an exception row. An event to act on
    without a timestamp is a bug of its gateway adapter, which refuses one
    as malformed: it raises `ValueError` and applies nothing.
    """
    if forced_outcome is None and event.kind is not None and event.occurred_at is None:
        raise ValueError(
            f"event {event.event_id!r} ({event.event_type}) has no gateway timestamp: "
            "the retention horizon cannot judge it"
        )
    key = {"tenant_id": endpoint.tenant_id, "event_id": event.event_id}
    horizon = horizon or receipt_horizon(DEFAULT_RECEIPT_RETENTION)
    if forced_outcome is None and beyond_horizon(event.occurred_at, horizon):
        forced_outcome = "beyond_horizon"
    acting = forced_outcome is None and event.kind is not None
    # Pipeline mode: BEGIN, the receipt insert and the order lock travel in
    # one round trip; the writes and COMMIT in a second.
    with pipelined_transaction(conn):
        receipt = conn.execute(
            query("insert_receipt"),
            key
            | {
                "event_type": event.event_type,
                "digest": event.digest,
                "endpoint_id": endpoint.id,
                "gateway": endpoint.gateway,
                "delivery_id": delivery_id,
                "occurred_at": event.occurred_at,
            },
        )
        # Locked after the receipt, in the same transaction: the lock order
        # is always receipt, then order. Only this delivery's own receipt
        # takes the lock; a duplicate locks nothing.
        mapped = conn.execute(
            query("lock_mapped_order"),
            key
            | {
                "lock": acting,
                "merchant_reference": event.merchant_reference,
                "gateway_order_id": event.gateway_order_id,
            },
        )
        inserted = receipt.fetchone() is not None
        rows = mapped.fetchall()
        archived_sha256 = rows[0]["archived_sha256"]
        if inserted and archived_sha256 is not None:
            # Archived, perhaps while the insert waited for that batch: the
            # event was handled long ago. Take the new receipt back.
            conn.execute(query("delete_receipt"), key)
            inserted = False
        if not inserted:
            stored = archived_sha256 or rows[0]["live_sha256"]
            assert stored is not None, "the conflicting receipt is committed, live or archived"
            return _duplicate(conn, endpoint, event, delivery_id, stored)

        if not acting:
            outcome = forced_outcome or "ignored"
            exception_id = None
            if outcome in EXCEPTION_OUTCOMES:
                detail = (
                    {"occurred_at": event.occurred_at.isoformat(), "horizon": horizon.isoformat()}
                    if outcome == "beyond_horizon" and event.occurred_at
                    else {}
                )
                exception_id = record_exception(
                    conn, endpoint, event, None, Decision(outcome, detail=detail)
                )
            mark_receipt(conn, key, outcome, None)
            return Applied(outcome, exception_id=exception_id)

        orders = [order_from_row(row) for row in rows if row["id"] is not None]
        decision = decide(event, orders)
        order_id = orders[0].id if len(orders) == 1 else None

        exception_id = None
        moved = None
        if decision.outcome == "applied":
            assert orders and decision.to_state is not None
            # Marks the receipt too.
            moved = write_transition(conn, endpoint, event, orders[0], decision)
        else:
            if decision.is_exception:
                exception_id = record_exception(conn, endpoint, event, order_id, decision)
            mark_receipt(conn, key, decision.outcome, order_id)
    # Read once the pipeline has ended and committed.
    parked = moved is not None and bool((moved.fetchone() or {}).get("parked"))
    return Applied(decision.outcome, order_id, exception_id, parked=parked)


def _duplicate(
    conn: psycopg.Connection[Row],
    endpoint: Endpoint,
    event: Event,
    delivery_id: str,
    stored_sha256: str,
) -> Applied:
    if stored_sha256 == event.digest:
        return Applied("duplicate")
    execute(
        conn,
        "insert_anomaly",
        {
            "tenant_id": endpoint.tenant_id,
            "event_id": event.event_id,
            "endpoint_id": endpoint.id,
            "delivery_id": delivery_id,
            "kind": "digest_conflict",
            "stored_sha256": stored_sha256,
            "received_sha256": event.digest,
        },
    )
    return Applied("digest_conflict")


def write_transition(
    conn: psycopg.Connection[Row],
    endpoint: Endpoint,
    event: Event,
    order: Order,
    decision: Decision,
) -> psycopg.Cursor[Row]:
    """Queue the state change, its audit row, its outbox row and the receipt's
    outcome, in one statement. If the order did not move (it always does,
    under the lock the caller holds), the statement fails and with it the
    transaction. Its cursor reads, once the statement ran, whether events of
    the order wait as exceptions (`parked`).
    """
    assert decision.action is not None, "every forward transition has a side effect"
    assert decision.refunded_minor is not None, "every forward transition states the refunds"
    # The amount this transition moved: the payment's, or this refund's. A
    # refund event carries either that refund or, from Stripe, the charge's
    # refunded total (`event.cumulative`); `decide` turned both into the
    # order's new total.
    amount = (
        decision.refunded_minor - order.refunded_minor
        if event.kind == "refunded"
        else event.amount_minor
    )
    payload = {
        "action": decision.action,
        "tenant_id": endpoint.tenant_id,
        "order_id": order.id,
        "merchant_reference": order.merchant_reference,
        "event_id": event.event_id,
        "state": decision.to_state,
        "amount_minor": amount,
        "refunded_minor": decision.refunded_minor,
        "currency": order.currency,
    }
    # The order is locked FOR UPDATE by this transaction: its state is the
    # one `decide` saw, so the move always happens.
    return conn.execute(
        query("apply_transition"),
        {
            "tenant_id": endpoint.tenant_id,
            "event_id": event.event_id,
            "order_id": order.id,
            "from_state": order.state,
            "to_state": decision.to_state,
            "refunded_minor": decision.refunded_minor,
            "amount_minor": amount,
            "outcome": decision.outcome,
            "outbox_id": uuid.uuid4(),
            "action": decision.action,
            "payload": Jsonb(payload),
        },
    )


def record_exception(
    conn: psycopg.Connection[Row],
    endpoint: Endpoint,
    event: Event,
    order_id: str | None,
    decision: Decision,
) -> int:
    row = fetch_one(
        conn,
        "insert_exception",
        {
            "tenant_id": endpoint.tenant_id,
            "event_id": event.event_id,
            "order_id": order_id,
            "kind": decision.outcome,
            "detail": Jsonb(decision.detail),
            "event": Jsonb(event.to_json() | {"endpoint_id": endpoint.id}),
        },
    )
    assert row is not None
    return int(row["id"])


def mark_receipt(
    conn: psycopg.Connection[Row], key: dict[str, Any], outcome: str, order_id: str | None
) -> None:
    conn.execute(query("mark_receipt_processed"), key | {"outcome": outcome, "order_id": order_id})


def order_from_row(row: Row) -> Order:
    return Order(
        id=str(row["id"]),
        merchant_reference=row["merchant_reference"],
        gateway_order_id=row["gateway_order_id"],
        amount_minor=row["amount_minor"],
        currency=row["currency"],
        state=row["state"],
        refunded_minor=row["refunded_minor"],
    )
