"""What one authentic event does to one locked order: a pure decision.

The rules live in one place, the SQL function `payhook.decide_v1`
(`sql/migrations/0009_*.sql`), and both ways an event is applied run them on
the server once they have locked the order: `payhook.apply_event_v2` for a
delivery, `payhook.replay_exception_v1` for a replay. `decide` asks them
from Python, for tests of each rule on its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from payhook.db import Row, fetch_one
from payhook.gateways import Event
from payhook.outcomes import EXCEPTION_KINDS, REFUSED_OUTCOMES, RESOLVING_OUTCOMES

__all__ = [
    "EXCEPTION_OUTCOMES",
    "REFUSED_OUTCOMES",
    "RESOLVING_OUTCOMES",
    "Decision",
    "Order",
    "decide",
]

#: Outcomes that write a `payment_exceptions` row: authentic but not applicable.
EXCEPTION_OUTCOMES = frozenset(EXCEPTION_KINDS)


@dataclass(frozen=True)
class Order:
    id: str
    merchant_reference: str
    gateway_order_id: str
    amount_minor: int
    currency: str
    state: str
    refunded_minor: int


@dataclass(frozen=True)
class Decision:
    """The outcome, and for `applied` the transition and its side effect."""

    outcome: str
    to_state: str | None = None
    refunded_minor: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    action: str | None = None

    @property
    def is_exception(self) -> bool:
        return self.outcome in EXCEPTION_OUTCOMES


def decide(conn: psycopg.Connection[Row], event: Event, orders: list[Order]) -> Decision:
    """The decision for `event` given the orders its identifiers mapped to (and
    the caller locked), as `payhook.decide_v1` takes it."""
    row = fetch_one(
        conn,
        "decide",
        {"event": Jsonb(event.to_json()), "orders": Jsonb([asdict(order) for order in orders])},
    )
    assert row is not None, "decide_v1 returns one row"
    return Decision(
        row["outcome"],
        to_state=row["to_state"],
        refunded_minor=row["refunded_minor"],
        detail=row["detail"],
        action=row["action"],
    )
