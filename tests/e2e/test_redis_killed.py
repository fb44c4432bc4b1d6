"""Redis killed under load: every event the ingress acknowledged is applied
exactly once, on a stack of its own (Redis with `appendfsync always`).

In a file of its own so that the suite's parallel workers run it beside the
other scenarios: a job caught in RQ's intermediate list by the kill comes
back only after RQ's minute, and this scenario waits for it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_scenarios import send
from tests.factories import StandardEvent

# One stack for the module: its tests run on one parallel worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("redis_killed")]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack() as running:
        yield running


def test_redis_killed_under_load_loses_no_acknowledged_event(stack: Stack) -> None:
    """Redis runs with appendfsync always: what the ingress acknowledged survives a SIGKILL."""
    shop = stack.shop()
    events = []
    for i in range(150):
        stack.order(shop, f"aof-{i}", f"pi_aof_{i}")
        events.append(StandardEvent(merchant_reference=f"aof-{i}", gateway_order_id=f"pi_aof_{i}"))
    acknowledged: list[StandardEvent] = []
    refused = Counter[int]()

    def gateway(batch: list[StandardEvent]) -> None:
        for event in batch:
            status = send(stack.url(shop, len(acknowledged) % 2), event, shop.secret)
            refused[status] += status != 202
            if status != 202:  # a gateway retries what was not acknowledged
                status = send(stack.url(shop), event, shop.secret, until_2xx=True)
            if status == 202:
                acknowledged.append(event)
            time.sleep(0.01)

    with stack.supervised():
        senders = [threading.Thread(target=gateway, args=(events[i::3],)) for i in range(3)]
        for t in senders:
            t.start()
        time.sleep(0.8)
        stack.redis.kill(signal.SIGKILL)
        time.sleep(1.0)
        stack.redis.start()
        for t in senders:
            t.join(timeout=120)
        took = stack.settle(timeout=180)
    print(
        f"redis kill: {len(acknowledged)} acknowledged, refused while down {dict(refused)}, "
        f"settled in {took:.1f}s"
    )
    assert len(acknowledged) == len(events)
    assert refused[503] + refused[0] > 0, "Redis was down during the load"
    ids = {e.event_id for e in acknowledged}
    with stack.db() as conn:
        rows = conn.execute(
            "SELECT event_id, outcome FROM payhook.payment_event_receipts WHERE tenant_id = %s",
            (shop.tenant_id,),
        ).fetchall()
    assert {r["event_id"] for r in rows} == ids
    assert Counter(r["outcome"] for r in rows) == {"applied": len(ids)}
