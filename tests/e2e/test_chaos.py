"""Chaos across real processes: every acknowledged event has exactly one effect
while consumers, the outbox worker and PostgreSQL are killed and restarted.

A stack of its own (the scenarios' fixtures and helpers), in a file of its
own so that the suite's parallel workers run it beside the other scenarios.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from payhook.gateways import adyen
from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_scenarios import fulfil_key, post, send, tenant_counts
from tests.factories import Shop, StandardEvent
from tests.processes import wait_until

# One stack for the module: its tests run on one parallel worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("chaos")]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack() as running:
        yield running


#: Events sent one per request (Standard Webhooks), and Adyen notifications of
#: BATCH items each: as many events again.
SINGLE = 150
BATCH = 3


def adyen_notification(shop: Shop, psps: list[str]) -> tuple[bytes, list[str]]:
    """A signed notification authorising each PSP reference; its event ids."""
    items = []
    for psp in psps:
        item: dict[str, Any] = {
            "additionalData": {},
            "amount": {"currency": "EUR", "value": 1999},
            "eventCode": "AUTHORISATION",
            "eventDate": "2026-12-01T10:00:00+01:00",
            "merchantAccountCode": "ChaosMerchant",
            "merchantReference": "",
            "pspReference": psp,
            "success": "true",
        }
        item["additionalData"]["hmacSignature"] = adyen.sign(shop.secret, item)
        items.append({"NotificationRequestItem": item})
    body = json.dumps({"live": "false", "notificationItems": items}).encode()
    return body, [f"AUTHORISATION:{psp}:true" for psp in psps]


def test_chaos_every_acknowledged_event_has_exactly_one_effect(stack: Stack) -> None:
    """300 events, each delivered three times at random moments, while consumers
    and the outbox worker are SIGKILLed and restarted at random and PostgreSQL
    restarts once: 150 one per request, 150 in Adyen notifications of 3."""
    rng = random.Random(20261130)
    shop = stack.shop()
    batched = stack.shop("adyen")
    events = []
    for i in range(SINGLE):
        stack.order(shop, f"chaos-{i}", f"pi_chaos_{i}")
        events.append(
            StandardEvent(merchant_reference=f"chaos-{i}", gateway_order_id=f"pi_chaos_{i}")
        )
    notifications: list[tuple[bytes, list[str]]] = []
    for n in range(SINGLE // BATCH):
        psps = [f"CHAOS{n:05d}{i:06d}" for i in range(BATCH)]
        for i, psp in enumerate(psps):
            stack.order(batched, f"chaos-a-{n}-{i}", psp)
        notifications.append(adyen_notification(batched, psps))
    deliveries: list[StandardEvent | tuple[bytes, list[str]]] = [
        *(e for e in events for _ in range(3)),
        *(n for n in notifications for _ in range(3)),
    ]
    rng.shuffle(deliveries)
    acknowledged: set[str] = set()
    lock = threading.Lock()
    stop_chaos = threading.Event()
    kills = Counter[str]()

    def gateway(batch: list[StandardEvent | tuple[bytes, list[str]]]) -> None:
        for n, delivery in enumerate(batch):
            if isinstance(delivery, StandardEvent):
                status = send(stack.url(shop, n % 2), delivery, shop.secret, until_2xx=True)
                ids = [delivery.event_id] if status == 202 else []
            else:
                body, event_ids = delivery
                status = post(stack.url(batched, n % 2), body, {}, until_2xx=True)
                ids = event_ids if status == 200 else []
            with lock:
                acknowledged.update(ids)
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
    expected = {
        shop.tenant_id: {fulfil_key(shop, e) for e in events},
        batched.tenant_id: {
            f"{batched.tenant_id}:{event_id}:fulfil_order"
            for _, ids in notifications
            for event_id in ids
        },
    }
    wait_until(
        lambda: all(
            len({k for k in stack.receiver.keys() if k.startswith(tenant)}) >= SINGLE
            for tenant in expected
        ),
        60,
        "every fulfilment at the receiver",
    )
    assert kills["postgres"] == 1 and kills["consumer"] > 0
    assert len(acknowledged) == 2 * SINGLE
    for tenant_shop in (shop, batched):
        keys = [k for k in stack.receiver.keys() if k.startswith(tenant_shop.tenant_id)]
        counts = tenant_counts(stack, tenant_shop)
        per_order = stack.count(
            "SELECT count(*) AS n FROM (SELECT order_id FROM payhook.payment_order_transitions"
            " WHERE tenant_id = %(t)s GROUP BY order_id HAVING count(*) = 1) once",
            {"t": tenant_shop.tenant_id},
        )
        print(
            f"chaos ({tenant_shop.gateway}): kills {dict(kills)}; "
            f"acknowledged {len(acknowledged)} events ({len(deliveries)} deliveries); "
            f"receipts {counts['receipts']}, transitions {counts['transitions']}, "
            f"outbox {counts['outbox']}, receiver requests {len(keys)}, "
            f"distinct keys {len(set(keys))}; settled in {took:.1f}s"
        )
        assert counts["receipts"] == SINGLE
        assert counts["transitions"] == SINGLE and per_order == SINGLE
        assert counts["outbox"] == SINGLE
        assert len(set(keys)) == counts["outbox"]
        assert set(keys) == expected[tenant_shop.tenant_id]
        assert counts["exceptions"] == 0 and counts["anomalies"] == 0
    assert stack.failed_jobs() == 0
