"""Re-apply the event of a payment exception once its cause is fixed.

The replay runs the consumer's own steps in one transaction, in the
consumer's lock order:

    0 lock the exception (two replays of it run one after the other)
    1 lock the event's receipt
    3 lock the mapped order FOR UPDATE
    4 decide again (payhook.decide_v1) against the order as it is now
    5 one forward transition and its audit row, 6 the outbox row
    7 mark the receipt with the new outcome, resolve the exception; commit

A resolved exception is never replayed again, so a second replay changes
nothing. A dry run takes the same locks and decisions, writes nothing, and
says what a replay would do.

An event can arrive before the one its order waits for (a refund before its
payment): it is kept as an `invalid_transition` exception. Whatever moves the
order afterwards, the consumer's transaction or a replay, learns in the same
statement that such events wait, and `replay_parked` replays them once it has
committed.
"""

from __future__ import annotations

from contextlib import suppress
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
import structlog
from psycopg import pq
from psycopg.types.json import Jsonb

from consumer.rules import Decision, Order, decide
from payhook.db import Row, error_summary, execute, fetch_all, fetch_one
from payhook.errors import NotFound, PayhookError
from payhook.gateways import Event
from payhook.queries import query

log = structlog.get_logger(__name__)

#: Outcomes after which the event is accounted for and its exception closes.
RESOLVING_OUTCOMES = frozenset({"applied", "already_applied", "superseded"})
#: How long the replay of a waiting event may wait for a lock (another replay
#: of it, a consumer on its order): it is best effort, inside a consumer's job.
PARKED_LOCK_TIMEOUT = "2s"


class NotReplayable(PayhookError):
    """The exception's event cannot be replayed."""


@dataclass(frozen=True)
class Replay:
    """What a replay did, or in a dry run would do."""

    exception_id: int
    tenant_id: str
    event_id: str
    #: The decision now: `applied`, `already_applied`, or the exception kind that
    #: still applies; `resolved` when the exception was already closed.
    outcome: str
    #: The exception is closed after this replay (or would be, in a dry run).
    resolved: bool
    #: This replay wrote something (or would, in a dry run).
    changed: bool
    dry_run: bool
    order_id: str | None = None
    from_state: str | None = None
    to_state: str | None = None
    action: str | None = None
    detail: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def replay_exception(
    conn: psycopg.Connection[Row],
    exception_id: int,
    *,
    tenant_id: str | None = None,
    dry_run: bool = False,
    lock_timeout: str | None = None,
    follow: bool = True,
) -> Replay:
    """Replay one exception's event; see the module docstring. Safe to call repeatedly.

    With `follow`, an event it applies is followed by the replay of the events
    of its order that waited for it (`replay_parked`).
    """
    parked_order = None
    with conn.transaction():
        if lock_timeout is not None:
            execute(conn, "local_lock_timeout", {"timeout": lock_timeout})
        row = fetch_one(conn, "lock_exception", {"id": exception_id, "tenant_id": tenant_id})
        if row is None:
            raise NotFound(f"no payment exception {exception_id}")
        tenant = str(row["tenant_id"])
        base = {"exception_id": exception_id, "tenant_id": tenant, "event_id": row["event_id"]}
        if row["resolved_at"] is not None:
            return Replay(**base, outcome="resolved", resolved=True, changed=False, dry_run=dry_run)

        if row["kind"] == "beyond_horizon":
            raise NotReplayable(
                f"exception {exception_id} is an event older than the retention horizon: "
                "applying it could repeat an effect whose receipt is gone; resolve it by hand"
            )
        event = _stored_event(row)
        if event.kind is None:
            raise NotReplayable(
                f"exception {exception_id} holds an event payhook cannot read "
                f"({row['kind']}); it can only be resolved by hand"
            )
        key = {"tenant_id": tenant, "event_id": event.event_id}
        receipt = fetch_one(conn, "lock_receipt", key)
        if receipt is None:
            raise NotReplayable(f"event {event.event_id} has no receipt any more")

        orders = [
            order_from_row(r)
            for r in fetch_all(
                conn,
                "lock_order",
                {
                    "tenant_id": tenant,
                    "merchant_reference": event.merchant_reference,
                    "gateway_order_id": event.gateway_order_id,
                },
            )
        ]
        order = orders[0] if len(orders) == 1 else None
        decision = (
            Decision("already_applied", detail={"receipt": receipt["outcome"]})
            if receipt["outcome"] in RESOLVING_OUTCOMES
            else decide(conn, event, orders)
        )
        resolves = decision.outcome in RESOLVING_OUTCOMES
        result = Replay(
            **base,
            outcome=decision.outcome,
            resolved=resolves,
            changed=resolves,
            dry_run=dry_run,
            order_id=order.id if order else None,
            from_state=order.state if order and decision.to_state else None,
            to_state=decision.to_state,
            action=decision.action,
            detail=decision.detail or None,
        )
        if dry_run or not resolves:
            return result

        if decision.outcome == "applied":
            assert order is not None
            # Marks the receipt too: it cannot have resolved already, or the
            # decision would be `already_applied`.
            if write_transition(conn, tenant, event, order, decision):
                parked_order = order.id
        elif receipt["outcome"] not in RESOLVING_OUTCOMES:
            mark_receipt(conn, key, decision.outcome, order.id if order else None)
        execute(
            conn,
            "resolve_exception",
            {"tenant_id": tenant, "id": exception_id, "resolution": f"replay:{decision.outcome}"},
        )
    if follow and parked_order is not None:
        replay_parked(conn, tenant, parked_order)
    return result


def replay_parked(conn: psycopg.Connection[Row], tenant_id: str, order_id: str) -> None:
    """Replay the events of an order that arrived too early (a refund before its
    payment), now that it moved: each in a transaction of its own, oldest first,
    none waiting more than `PARKED_LOCK_TIMEOUT` for a lock.

    After the commit that moved the order, and best effort: nothing raised
    here reaches the caller, whose event is applied. An event that still
    cannot apply, a replay that fails or is cut short (a job's timeout), or a
    crash before, leaves its exception open for `payhook exceptions replay`.
    """
    try:
        waiting = fetch_all(
            conn, "parked_exceptions", {"tenant_id": tenant_id, "order_id": order_id}
        )
    except Exception as exc:
        log.warning("parked_events_unread", order_id=order_id, error=error_summary(exc))
        _drop_if_busy(conn)
        return
    for row in waiting:
        try:
            replay = replay_exception(
                conn, row["id"], tenant_id=tenant_id, lock_timeout=PARKED_LOCK_TIMEOUT, follow=False
            )
        except NotReplayable as exc:
            log.warning("parked_event_not_replayable", exception_id=row["id"], reason=str(exc))
            continue
        except psycopg.Error as exc:
            # A lock not had in time, say: that transaction is rolled back.
            log.warning(
                "parked_event_replay_failed", exception_id=row["id"], error=error_summary(exc)
            )
            if _drop_if_busy(conn):
                return
            continue
        except Exception as exc:
            # Interrupted (the job's timeout): no more replays in this job.
            log.warning(
                "parked_event_replay_interrupted", exception_id=row["id"], error=error_summary(exc)
            )
            _drop_if_busy(conn)
            return
        log.info(
            "parked_event_replayed",
            exception_id=row["id"],
            replayed_event_id=replay.event_id,
            outcome=replay.outcome,
            resolved=replay.resolved,
        )


def _drop_if_busy(conn: psycopg.Connection[Row]) -> bool:
    """Close a connection left mid-statement, after cancelling the statement on
    the server; the pool drops it. Whether it was (or is) unusable."""
    if conn.closed:
        return True
    if conn.pgconn.transaction_status == pq.TransactionStatus.IDLE:
        return False
    with suppress(psycopg.Error):
        conn.cancel_safe(timeout=5)
    conn.close()
    return True


def write_transition(
    conn: psycopg.Connection[Row], tenant_id: str, event: Event, order: Order, decision: Decision
) -> bool:
    """Steps 5 to 7 for an event decided `applied` against `order`, which this
    transaction holds FOR UPDATE (`payhook.write_transition_v1`, as the
    consumer's own transaction runs them). If the order did not move, the
    statement fails and with it the transaction. Whether events of the order
    wait as exceptions (arrived too early).
    """
    assert decision.action is not None, "every forward transition has a side effect"
    assert decision.refunded_minor is not None, "every forward transition states the refunds"
    row = conn.execute(
        query("apply_transition"),
        {
            "tenant_id": tenant_id,
            "event": Jsonb(event.to_json()),
            "order": Jsonb(asdict(order)),
            "to_state": decision.to_state,
            "refunded_minor": decision.refunded_minor,
            "action": decision.action,
        },
    ).fetchone()
    return bool(row and row["parked"])


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


def resolve_by_hand(
    conn: psycopg.Connection[Row], exception_id: int, *, tenant_id: str | None = None
) -> bool:
    """Close an exception without applying its event; False if it was already closed."""
    with conn.transaction():
        row = fetch_one(conn, "lock_exception", {"id": exception_id, "tenant_id": tenant_id})
        if row is None:
            raise NotFound(f"no payment exception {exception_id}")
        if row["resolved_at"] is not None:
            return False
        execute(
            conn,
            "resolve_exception",
            {"tenant_id": row["tenant_id"], "id": exception_id, "resolution": "by_hand"},
        )
    return True


def _stored_event(row: Row) -> Event:
    """The event an exception recorded; the endpoint it came through is not
    needed: it was authenticated then, and the transition needs its tenant only."""
    data = dict(row["event"])
    data.pop("endpoint_id", None)
    try:
        return Event.from_json(data)
    except (TypeError, ValueError) as exc:
        raise NotReplayable(f"exception {row['id']} holds an unreadable event: {exc}") from None
