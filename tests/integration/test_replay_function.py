"""`payhook.replay_exception_v1`: the replay of an exception, one statement on the server."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import psycopg
import pytest

from consumer.replay import PARKED_LOCK_TIMEOUT, NotReplayable, replay_exception
from consumer.transaction import Applied, apply_event
from payhook.db import Row, connect
from payhook.endpoints import Endpoint
from payhook.errors import NotFound
from payhook.gateways import get_gateway
from payhook.queries import all_queries
from payhook.settings import Settings
from tests.factories import Factory, Shop, StandardEvent

#: The tables a replay may write.
TABLES = (
    "payment_orders",
    "payment_event_receipts",
    "payment_order_transitions",
    "payment_outbox",
    "payment_exceptions",
)


def apply(conn: psycopg.Connection[Row], shop: Shop, event: StandardEvent) -> Applied:
    """One delivery of `event`, through the consumer's transaction."""
    body = event.body()
    parsed = get_gateway("standard").parse(event.headers(shop.secret, body), body)
    endpoint = Endpoint(shop.endpoint_id, shop.tenant_id, "standard", (shop.secret,))
    return apply_event(conn, endpoint, parsed, str(uuid.uuid4()))


def waiting_payment(conn: psycopg.Connection[Row], factory: Factory) -> tuple[Shop, str, int, int]:
    """A payment kept as an exception before its order existed, the order
    created since, and a refund of it waiting for the payment."""
    shop = factory.shop()
    payment = apply(
        conn, shop, StandardEvent(merchant_reference="order-9", gateway_order_id="pi_9")
    )
    assert payment.outcome == "unmapped_order" and payment.exception_id is not None
    order_id = factory.order(shop, "order-9", "pi_9")
    refund = StandardEvent(
        type="payment.refunded", merchant_reference="order-9", gateway_order_id="pi_9", amount=500
    )
    parked = apply(conn, shop, refund)
    assert parked.outcome == "invalid_transition" and parked.exception_id is not None
    return shop, order_id, payment.exception_id, parked.exception_id


def snapshot(factory: Factory) -> dict[str, list[Any]]:
    """Every row of every table a replay may write."""
    rows: dict[str, list[Any]] = {}
    for table in TABLES:
        found = factory.conn.execute(
            f"SELECT to_jsonb(t) AS r FROM payhook.{table} AS t",
        ).fetchall()
        rows[table] = sorted((r["r"] for r in found), key=repr)
    return rows


def open_exceptions(factory: Factory) -> int:
    row = factory.conn.execute(
        "SELECT count(*) AS n FROM payhook.payment_exceptions WHERE resolved_at IS NULL"
    ).fetchone()
    assert row is not None
    return int(row["n"])


def test_a_dry_run_writes_nothing_and_decides_as_the_replay_does(
    conn: psycopg.Connection[Row], factory: Factory
) -> None:
    _, order_id, exception_id, _ = waiting_payment(conn, factory)
    before = snapshot(factory)

    dry = replay_exception(conn, exception_id, dry_run=True)

    assert snapshot(factory) == before
    real = replay_exception(conn, exception_id)
    assert dataclasses.replace(dry, dry_run=False) == real
    assert (real.outcome, real.order_id, real.from_state, real.to_state) == (
        "applied",
        order_id,
        "pending",
        "paid",
    )
    assert factory.count("payment_order_transitions", order_id=order_id) == 2, (
        "the payment, then the refund that waited for it"
    )
    assert factory.order_totals(order_id) == {"state": "partially_refunded", "refunded_minor": 500}
    assert open_exceptions(factory) == 0


def test_a_dry_run_holds_the_replays_locks_until_its_transaction_ends(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    """Exception, receipt and order, as a replay locks them."""
    shop, order_id, exception_id, _ = waiting_payment(conn, factory)
    event_id = factory.conn.execute(
        "SELECT event_id FROM payhook.payment_exceptions WHERE id = %s", (exception_id,)
    ).fetchone()
    assert event_id is not None
    # The exception, the receipt, the order.
    rows = (
        ("SELECT 1 FROM payhook.payment_exceptions WHERE id = %s", exception_id),
        ("SELECT 1 FROM payhook.payment_event_receipts WHERE event_id = %s", event_id["event_id"]),
        ("SELECT 1 FROM payhook.payment_orders WHERE id = %s", order_id),
    )
    with connect(settings, "other", owner=True) as other:
        with conn.transaction():
            replay_exception(conn, exception_id, dry_run=True)
            for select, key in rows:
                with pytest.raises(psycopg.errors.LockNotAvailable), other.transaction():
                    other.execute(f"{select} FOR UPDATE NOWAIT", (key,))
        with other.transaction():
            for select, key in rows:
                other.execute(f"{select} FOR UPDATE NOWAIT", (key,))
    assert factory.order_state(shop, order_id) == "pending"


def test_a_replay_is_one_statement(
    factory: Factory, settings: Settings, conn: psycopg.Connection[Row]
) -> None:
    """The operator's replay sends the function's call alone (after finding
    the exception's tenant, when not given); the replay of a waiting event
    sets its lock timeout first, in the same transaction."""
    shop, _, exception_id, parked_id = waiting_payment(conn, factory)
    names = {text: name for name, text in all_queries().items()}
    sent: list[str] = []

    class Recording(psycopg.Cursor[Row]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            sent.append(names.get(str(query), str(query)))
            return super().execute(query, params, **kwargs)

    with connect(settings, "replay") as own:
        own.cursor_factory = Recording
        replay_exception(own, exception_id, tenant_id=shop.tenant_id, follow=False)
        assert sent == ["replay_exception"]
        sent.clear()
        replay_exception(own, parked_id, lock_timeout=PARKED_LOCK_TIMEOUT, follow=False)
        assert sent == ["tenant_of", "local_lock_timeout", "replay_exception"]
    assert open_exceptions(factory) == 0


def test_refusals_raise_payhooks_own_sqlstates(
    conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop, _, exception_id, _ = waiting_payment(conn, factory)
    other = factory.shop()

    with pytest.raises(psycopg.Error) as raised:
        conn.execute("SELECT * FROM payhook.replay_exception_v1(-1, NULL, true)")
    assert raised.value.sqlstate == "PH001"
    with pytest.raises(NotFound, match=f"no payment exception {exception_id}"):
        replay_exception(conn, exception_id, tenant_id=other.tenant_id)

    # A field the function does not know could change what the event means.
    factory.conn.execute(
        "UPDATE payhook.payment_exceptions SET event = event || '{\"partial\": true}'"
        " WHERE id = %s",
        (exception_id,),
    )
    with pytest.raises(NotReplayable, match="unreadable event") as refused:
        replay_exception(conn, exception_id, tenant_id=shop.tenant_id)
    assert isinstance(refused.value.__cause__, psycopg.Error)
    assert refused.value.__cause__.sqlstate == "PH002"
    factory.conn.execute(
        "UPDATE payhook.payment_exceptions SET event = event - 'partial' WHERE id = %s",
        (exception_id,),
    )
    factory.conn.execute(
        "DELETE FROM payhook.payment_event_receipts AS r USING payhook.payment_exceptions AS x"
        " WHERE x.id = %s AND r.tenant_id = x.tenant_id AND r.event_id = x.event_id",
        (exception_id,),
    )
    with pytest.raises(NotReplayable, match="has no receipt any more"):
        replay_exception(conn, exception_id, dry_run=True)
    assert factory.count("payment_order_transitions") == 0
