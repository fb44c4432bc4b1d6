"""The consumer transaction against real PostgreSQL."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from consumer.handler import Runtime, handle
from payhook.db import create_pool
from payhook.settings import Settings
from tests.factories import Factory, StandardEvent


@pytest.fixture
def runtime(settings: Settings):
    pool = create_pool(settings, "test", size=4)
    pool.open(wait=True)
    yield Runtime(settings=settings, pool=pool)
    pool.close()


def apply(runtime: Runtime, factory: Factory, shop, event: StandardEvent) -> str:
    return handle(runtime, factory.standard_envelope(shop, event).to_json()).outcome


def test_valid_payment_is_applied_once(runtime: Runtime, factory: Factory) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent()
    assert apply(runtime, factory, shop, event) == "applied"
    assert apply(runtime, factory, shop, event) == "duplicate"
    assert factory.order_state(shop, order_id) == "paid"
    assert factory.count("payment_event_receipts", outcome="applied") == 1
    assert factory.count("payment_order_transitions", order_id=order_id, to_state="paid") == 1
    assert factory.count("payment_outbox", order_id=order_id, action="fulfil_order") == 1


def test_twenty_threads_apply_one_event_once(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    """20 threads, each with its own connection, deliver the same event at once."""
    shop = factory.shop()
    order_id = factory.order(shop)
    job = factory.standard_envelope(shop, StandardEvent()).to_json()
    pool = create_pool(settings, "test", size=20)
    pool.open(wait=True)
    threaded = Runtime(settings=settings, pool=pool)
    barrier = threading.Barrier(20)
    outcomes: list[str] = []

    def deliver() -> None:
        barrier.wait()
        outcomes.append(handle(threaded, job).outcome)

    threads = [threading.Thread(target=deliver) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    pool.close()
    assert not any(t.is_alive() for t in threads), "a delivery did not finish in bounded time"
    assert Counter(outcomes) == {"applied": 1, "duplicate": 19}
    assert factory.count("payment_event_receipts") == 1
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert factory.count("payment_outbox", order_id=order_id) == 1
