"""Re-apply the event of a payment exception once its cause is fixed.

Both ways an event is applied are SQL functions that share the rules,
`payhook.decide_v1`, and the writes, `payhook.write_transition_v1`: a
delivery runs `payhook.apply_event_v2` (`consumer.transaction`), a replay
`payhook.replay_exception_v1` (`sql/migrations/0010_*.sql`), one statement
that locks the exception, then the event's receipt, then its order FOR
UPDATE (the consumer's lock order, receipt then order, behind a lock no
delivery takes), decides again against the order as it is now, writes the
transition, outbox row and receipt outcome, and resolves the exception.

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
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog
from psycopg import pq

from payhook.db import (
    Row,
    error_summary,
    execute,
    fetch_all,
    fetch_one,
    tenant_of,
    tenant_transaction,
)
from payhook.errors import NotFound, PayhookError

log = structlog.get_logger(__name__)

#: How long the replay of a waiting event may wait for a lock (another replay
#: of it, a consumer on its order): it is best effort, inside a consumer's job.
PARKED_LOCK_TIMEOUT = "2s"
#: SQLSTATE `replay_exception_v1` raises when there is no such exception.
NO_SUCH_EXCEPTION = "PH001"
#: SQLSTATE it raises for an event it must not or cannot replay.
NOT_REPLAYABLE_EVENT = "PH002"


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

    `NotFound` if there is no such exception (of `tenant_id`, when given),
    `NotReplayable` if its event must not or cannot be applied. With
    `lock_timeout`, no lock is waited for longer. With `follow`, an event
    it applies is followed by the replay of the events of its order that
    waited for it (`replay_parked`).
    """
    if tenant_id is None:
        tenant_id = tenant_of(conn, "payment_exceptions", exception_id)
        if tenant_id is None:
            raise NotFound(f"no payment exception {exception_id}")
    params = {"id": exception_id, "tenant_id": tenant_id, "dry_run": dry_run}
    try:
        if lock_timeout is None and conn.autocommit:
            # Its own transaction: no lock is held across a round trip.
            row = fetch_one(conn, "replay_exception", params)
        else:
            with conn.transaction():
                if lock_timeout is not None:
                    execute(conn, "local_lock_timeout", {"timeout": lock_timeout})
                row = fetch_one(conn, "replay_exception", params)
    except psycopg.Error as exc:
        # The function's refusals name ids and kinds only, never the event's content.
        if exc.sqlstate == NO_SUCH_EXCEPTION:
            raise NotFound(exc.diag.message_primary) from exc
        if exc.sqlstate == NOT_REPLAYABLE_EVENT:
            raise NotReplayable(exc.diag.message_primary) from exc
        raise
    assert row is not None, "replay_exception_v1 returns one row"
    order_id = None if row["order_id"] is None else str(row["order_id"])
    result = Replay(
        exception_id=exception_id,
        tenant_id=str(row["tenant_id"]),
        event_id=row["event_id"],
        outcome=row["outcome"],
        resolved=row["resolved"],
        changed=row["changed"],
        dry_run=dry_run,
        order_id=order_id,
        from_state=row["from_state"],
        to_state=row["to_state"],
        action=row["action"],
        detail=row["detail"],
    )
    if follow and row["parked"] and order_id is not None:
        replay_parked(conn, result.tenant_id, order_id)
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
        with tenant_transaction(conn, tenant_id):
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


def resolve_by_hand(
    conn: psycopg.Connection[Row], exception_id: int, *, tenant_id: str | None = None
) -> bool:
    """Close an exception without applying its event; False if it was already closed."""
    if tenant_id is None:
        tenant_id = tenant_of(conn, "payment_exceptions", exception_id)
        if tenant_id is None:
            raise NotFound(f"no payment exception {exception_id}")
    with tenant_transaction(conn, tenant_id):
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
