"""`payhook exceptions replay`: an exception's event re-applied once, through the normal steps."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import psycopg
import pytest

from consumer import replay as replay_module
from consumer.replay import (
    NotReplayable,
    Replay,
    replay_exception,
    replay_parked,
    resolve_by_hand,
)
from consumer.transaction import Applied, apply_event
from payhook.db import Row, connect
from payhook.endpoints import Endpoint
from payhook.gateways import Event, get_gateway
from payhook.settings import Settings
from tests.factories import Factory, Shop, StandardEvent
from tests.processes import process_env


def apply(conn: psycopg.Connection[Row], shop: Shop, event: StandardEvent) -> Applied:
    """One delivery of `event`, through the consumer's transaction."""
    body = event.body()
    parsed = get_gateway("standard").parse(event.headers(shop.secret, body), body)
    endpoint = Endpoint(shop.endpoint_id, shop.tenant_id, "standard", (shop.secret,))
    return apply_event(conn, endpoint, parsed, str(uuid.uuid4()))


def receipt_outcome(factory: Factory, shop: Shop, event_id: str) -> str:
    row = factory.conn.execute(
        "SELECT outcome FROM payhook.payment_event_receipts WHERE tenant_id = %s AND event_id = %s",
        (shop.tenant_id, event_id),
    ).fetchone()
    assert row is not None
    return str(row["outcome"])


def is_open(factory: Factory, exception_id: int) -> bool:
    row = factory.conn.execute(
        "SELECT resolved_at FROM payhook.payment_exceptions WHERE id = %s", (exception_id,)
    ).fetchone()
    assert row is not None
    return row["resolved_at"] is None


def unmapped(conn: psycopg.Connection[Row], factory: Factory) -> tuple[Shop, StandardEvent, int]:
    """An authentic payment for an order the shop has not created yet."""
    shop = factory.shop()
    event = StandardEvent(merchant_reference="order-9", gateway_order_id="pi_9", amount=2500)
    applied = apply(conn, shop, event)
    assert applied.outcome == "unmapped_order" and applied.exception_id is not None
    return shop, event, applied.exception_id


def test_replay_applies_an_unmapped_event_once_its_order_exists(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    shop, event, exception_id = unmapped(conn, factory)
    order_id = factory.order(shop, "order-9", "pi_9", amount=2500)

    dry = replay_exception(conn, exception_id, dry_run=True)
    assert dry == Replay(
        exception_id=exception_id,
        tenant_id=shop.tenant_id,
        event_id=event.event_id,
        outcome="applied",
        resolved=True,
        changed=True,
        dry_run=True,
        order_id=order_id,
        from_state="pending",
        to_state="paid",
        action="fulfil_order",
    )
    assert factory.order_state(shop, order_id) == "pending"
    assert factory.count("payment_order_transitions") == 0
    assert factory.count("payment_outbox") == 0
    assert is_open(factory, exception_id)
    assert receipt_outcome(factory, shop, event.event_id) == "unmapped_order"

    # The operator's command, as run from a shell.
    done = subprocess.run(
        [sys.executable, "-m", "control.cli", "exceptions", "replay", str(exception_id)],
        env=process_env(settings),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert '"outcome": "applied"' in done.stdout and '"changed": true' in done.stdout
    assert factory.order_state(shop, order_id) == "paid"
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert factory.count("payment_outbox", order_id=order_id, action="fulfil_order") == 1
    assert not is_open(factory, exception_id)
    assert receipt_outcome(factory, shop, event.event_id) == "applied"

    again = replay_exception(conn, exception_id)
    assert (again.outcome, again.changed, again.resolved) == ("resolved", False, True)
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert factory.count("payment_outbox", order_id=order_id) == 1


def test_concurrent_replays_of_one_exception_apply_it_once(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    shop, _, exception_id = unmapped(conn, factory)
    order_id = factory.order(shop, "order-9", "pi_9", amount=2500)
    results: list[Replay] = []
    start = threading.Barrier(4)

    def replay() -> None:
        with connect(settings, "test") as own:
            start.wait()
            results.append(replay_exception(own, exception_id))

    threads = [threading.Thread(target=replay) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(r.changed for r in results) == [False, False, False, True]
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert factory.count("payment_outbox", order_id=order_id) == 1


def test_replay_while_the_cause_is_not_fixed_changes_nothing(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop, amount=1999)
    applied = apply(conn, shop, StandardEvent(amount=500))
    assert applied.outcome == "amount_mismatch" and applied.exception_id is not None

    result = replay_exception(conn, applied.exception_id)
    assert (result.outcome, result.resolved, result.changed) == ("amount_mismatch", False, False)
    assert result.detail == {"expected": 1999, "received": 500, "state": "pending"}
    assert factory.order_state(shop, order_id) == "pending"
    assert is_open(factory, applied.exception_id)
    done = subprocess.run(
        [sys.executable, "-m", "control.cli", "exceptions", "replay", str(applied.exception_id)],
        env=process_env(settings),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1, "a replay that resolves nothing must not look like success"


def test_replay_of_an_event_another_event_already_applied_resolves_without_effect(
    conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop, _, exception_id = unmapped(conn, factory)
    order_id = factory.order(shop, "order-9", "pi_9", amount=2500)
    second = StandardEvent(merchant_reference="order-9", gateway_order_id="pi_9", amount=2500)
    assert apply(conn, shop, second).outcome == "applied"

    result = replay_exception(conn, exception_id)
    assert (result.outcome, result.resolved, result.changed) == ("already_applied", True, True)
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert not is_open(factory, exception_id)


def test_an_unreadable_event_is_not_replayed_but_can_be_resolved_by_hand(
    conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop = factory.shop()
    endpoint = Endpoint(shop.endpoint_id, shop.tenant_id, "standard", (shop.secret,))
    unreadable = Event.unreadable("msg_unreadable", "unreadable", "0" * 64)
    applied = apply_event(conn, endpoint, unreadable, str(uuid.uuid4()), forced_outcome="malformed")
    assert applied.exception_id is not None
    with pytest.raises(NotReplayable):
        replay_exception(conn, applied.exception_id)
    assert resolve_by_hand(conn, applied.exception_id) is True
    assert resolve_by_hand(conn, applied.exception_id) is False
    assert not is_open(factory, applied.exception_id)


def test_an_event_beyond_the_horizon_is_never_replayed(
    conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    ancient = apply(conn, shop, StandardEvent(timestamp=int(time.time()) - 401 * 86400))
    assert ancient.outcome == "beyond_horizon" and ancient.exception_id is not None
    with pytest.raises(NotReplayable, match="retention horizon"):
        replay_exception(conn, ancient.exception_id)
    assert factory.order_state(shop, order_id) == "pending"
    assert is_open(factory, ancient.exception_id)


def test_replay_settles_what_earlier_releases_refused_out_of_order(
    conn: psycopg.Connection[Row], factory: Factory
) -> None:
    """Earlier releases kept a refund delivered after its order's dispute, and
    a failed attempt delivered after the payment, as exceptions: a replay now
    applies the refund to the disputed order and closes the failure."""
    shop = factory.shop()
    order_id = factory.order(shop)
    refund = StandardEvent(type="payment.refunded", amount=500)
    failure = StandardEvent(type="payment.failed", amount=1)
    refused = apply(conn, shop, refund)
    mismatched = apply(conn, shop, failure)
    assert (refused.outcome, mismatched.outcome) == ("invalid_transition", "amount_mismatch")
    assert refused.exception_id is not None and mismatched.exception_id is not None

    # The order was paid, then disputed, while the two waited as exceptions.
    factory.conn.execute(
        "UPDATE payhook.payment_orders SET state = 'disputed' WHERE id = %s", (order_id,)
    )
    replayed = replay_exception(conn, refused.exception_id)
    assert (replayed.outcome, replayed.to_state, replayed.action) == (
        "applied",
        "disputed",
        "notify_refund",
    )
    settled = replay_exception(conn, mismatched.exception_id)
    assert (settled.outcome, settled.resolved, settled.to_state) == ("superseded", True, None)

    assert not is_open(factory, refused.exception_id)
    assert not is_open(factory, mismatched.exception_id)
    assert receipt_outcome(factory, shop, refund.event_id) == "applied"
    assert receipt_outcome(factory, shop, failure.event_id) == "superseded"
    order = factory.order_totals(order_id)
    assert order == {"state": "disputed", "refunded_minor": 500}
    assert factory.count("payment_outbox", order_id=order_id, action="notify_refund") == 1


def test_a_replay_that_pays_an_order_applies_the_refund_that_waited_for_it(
    conn: psycopg.Connection[Row], factory: Factory
) -> None:
    """The payment came before its order was created, the refund after it:
    the operator's replay of the payment is enough."""
    shop, _, exception_id = unmapped(conn, factory)
    refund = StandardEvent(
        type="payment.refunded", merchant_reference="order-9", gateway_order_id="pi_9", amount=500
    )
    factory.order(shop, "order-9", "pi_9", amount=2500)
    assert apply(conn, shop, refund).outcome == "invalid_transition"

    replay = replay_exception(conn, exception_id)

    assert (replay.outcome, replay.resolved) == ("applied", True)
    assert receipt_outcome(factory, shop, refund.event_id) == "applied"
    assert factory.count("payment_outbox", action="notify_refund") == 1
    still_open = factory.conn.execute(
        "SELECT count(*) AS n FROM payhook.payment_exceptions WHERE resolved_at IS NULL"
    ).fetchone()
    assert still_open == {"n": 0}


def test_the_replay_of_a_waiting_event_gives_up_on_a_held_lock_and_the_event_stays_applied(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    """Best effort, after the payment's commit: a replay that cannot have its
    lock in time leaves the refund for an operator, and the payment applied."""
    shop = factory.shop()
    order_id = factory.order(shop)
    refund = apply(conn, shop, StandardEvent(type="payment.refunded", amount=500))
    assert refund.exception_id is not None
    payment = apply(conn, shop, StandardEvent())
    assert (payment.outcome, payment.parked) == ("applied", True)
    with connect(settings, "holder", owner=True) as holder, holder.transaction():
        holder.execute(
            "SELECT 1 FROM payhook.payment_exceptions WHERE id = %s FOR UPDATE",
            (refund.exception_id,),
        )
        conn.execute("SET statement_timeout = '20s'")  # fails, not hangs, without the bound
        started = time.monotonic()
        replay_parked(conn, shop.tenant_id, order_id)
        waited = time.monotonic() - started
    assert waited < 10, "bounded by the replay's lock timeout"
    assert is_open(factory, refund.exception_id)
    assert factory.order_state(shop, order_id) == "paid"
    assert not conn.closed, "a lock timeout leaves the connection usable"
    replay_parked(conn, shop.tenant_id, order_id)
    assert not is_open(factory, refund.exception_id)
    assert factory.order_state(shop, order_id) == "partially_refunded"


def test_an_interrupted_replay_of_waiting_events_stops_them_and_reaches_no_one(
    conn: psycopg.Connection[Row], factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's timeout (RQ raises it from a signal) during the replays: the
    event that moved the order is committed, its job must not fail."""
    shop = factory.shop()
    order_id = factory.order(shop)
    for amount in (300, 500):
        apply(conn, shop, StandardEvent(type="payment.refunded", amount=amount))
    assert apply(conn, shop, StandardEvent()).parked
    calls: list[int] = []

    class JobTimeout(Exception):
        pass

    def interrupted(conn: psycopg.Connection[Row], exception_id: int, **_: object) -> Replay:
        calls.append(exception_id)
        raise JobTimeout("the job's timeout")

    monkeypatch.setattr(replay_module, "replay_exception", interrupted)
    replay_parked(conn, shop.tenant_id, order_id)
    assert len(calls) == 1, "no more replays after an interruption"
    assert factory.order_state(shop, order_id) == "paid"
    assert conn.execute("SELECT 1 AS ok").fetchone() == {"ok": 1}, "the connection still serves"
