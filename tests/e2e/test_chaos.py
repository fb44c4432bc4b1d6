"""Chaos across real processes: every acknowledged event has exactly one effect
while consumers, the outbox worker and PostgreSQL are killed and restarted.

A stack of its own (the scenarios' fixtures and helpers), in a file of its
own so that the suite's parallel workers run it beside the other scenarios.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_scenarios import fulfil_key, send, tenant_counts
from tests.factories import StandardEvent
from tests.processes import wait_until

# One stack for the module: its tests run on one parallel worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("chaos")]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack() as running:
        yield running


def test_chaos_every_acknowledged_event_has_exactly_one_effect(stack: Stack) -> None:
    """300 events, each also redelivered twice at random moments, while consumers and the
    outbox worker are SIGKILLed and restarted at random and PostgreSQL restarts once."""
    rng = random.Random(20261130)
    shop = stack.shop()
    events = []
    for i in range(300):
        stack.order(shop, f"chaos-{i}", f"pi_chaos_{i}")
        events.append(
            StandardEvent(merchant_reference=f"chaos-{i}", gateway_order_id=f"pi_chaos_{i}")
        )
    deliveries = [e for e in events for _ in range(3)]
    rng.shuffle(deliveries)
    acknowledged: set[str] = set()
    lock = threading.Lock()
    stop_chaos = threading.Event()
    kills = Counter[str]()

    def gateway(batch: list[StandardEvent]) -> None:
        for n, event in enumerate(batch):
            status = send(stack.url(shop, n % 2), event, shop.secret, until_2xx=True)
            if status == 202:
                with lock:
                    acknowledged.add(event.event_id)
            time.sleep(0.02)

    def chaos() -> None:
        restarted_pg = False
        started = time.monotonic()
        while not stop_chaos.wait(rng.uniform(1.5, 3.0)):
            victims = stack.alive(stack.consumers) + stack.alive(stack.outbox)
            if victims:
                victim = rng.choice(victims)
                kills["outbox" if victim in stack.outbox else "consumer"] += 1
                victim.send_signal(signal.SIGKILL)
            if not restarted_pg and time.monotonic() - started > 4:
                stack.pg.stop("immediate")
                time.sleep(1.0)
                stack.pg.start()
                restarted_pg = True
                kills["postgres"] += 1

    with stack.supervised():
        senders = [threading.Thread(target=gateway, args=(deliveries[i::4],)) for i in range(4)]
        agent = threading.Thread(target=chaos)
        agent.start()
        for t in senders:
            t.start()
        for t in senders:
            t.join(timeout=300)
        stop_chaos.set()
        agent.join()
        took = stack.settle(timeout=240)
    wait_until(
        lambda: len({k for k in stack.receiver.keys() if k.startswith(shop.tenant_id)}) >= 300,
        60,
        "every fulfilment at the receiver",
    )
    keys = [k for k in stack.receiver.keys() if k.startswith(shop.tenant_id)]
    counts = tenant_counts(stack, shop)
    per_order = stack.count(
        "SELECT count(*) AS n FROM (SELECT order_id FROM payhook.payment_order_transitions"
        " WHERE tenant_id = %(t)s GROUP BY order_id HAVING count(*) = 1) once",
        {"t": shop.tenant_id},
    )
    print(
        f"chaos: kills {dict(kills)}; acknowledged {len(acknowledged)} events "
        f"({len(deliveries)} deliveries); receipts {counts['receipts']}, "
        f"transitions {counts['transitions']}, outbox {counts['outbox']}, "
        f"receiver requests {len(keys)}, distinct keys {len(set(keys))}; settled in {took:.1f}s"
    )
    assert kills["postgres"] == 1 and kills["consumer"] > 0
    assert len(acknowledged) == 300
    assert counts["receipts"] == 300
    assert counts["transitions"] == 300 and per_order == 300
    assert counts["outbox"] == 300
    assert len(set(keys)) == counts["outbox"]
    assert set(keys) == {fulfil_key(shop, e) for e in events}
    assert counts["exceptions"] == 0 and counts["anomalies"] == 0
    assert stack.failed_jobs() == 0
