"""The system's promise across real processes: one effect per authentic event.

One stack for the module (its own PostgreSQL and Redis, 2 ingress instances,
3 consumers, 1 outbox worker, a recording receiver); every scenario uses a
tenant of its own, so they cannot see each other's rows.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from control.sender import Event as SendEvent
from control.sender import sign_event
from payhook.gateways import adyen, gocardless
from payhook.gateways.base import Config
from tests.e2e.stack import Stack, running_stack
from tests.factories import Shop, StandardEvent
from tests.gateway_api import FakeApi
from tests.processes import stop, wait_until

# One stack for the module: its tests run on one parallel worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("scenarios")]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack() as running:
        yield running


def send(url: str, event: StandardEvent, secret: str, *, until_2xx: bool = False) -> int:
    """POST like a gateway: the signed body; with `until_2xx`, retry until acknowledged."""
    body = event.body()
    return post(url, body, event.headers(secret, body), until_2xx=until_2xx)


def post(url: str, body: bytes, headers: dict[str, str], *, until_2xx: bool = False) -> int:
    """POST a signed request; with `until_2xx`, retry until acknowledged."""
    headers = headers | {"content-type": "application/json"}
    deadline = time.monotonic() + 60
    while True:
        try:
            status = httpx.post(url, content=body, headers=headers, timeout=10).status_code
        except httpx.HTTPError:
            status = 0
        if not until_2xx or 200 <= status < 300 or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def fulfil_key(shop: Shop, event: StandardEvent) -> str:
    return f"{shop.tenant_id}:{event.event_id}:fulfil_order"


def deadlocks(stack: Stack) -> int:
    return stack.count(
        "SELECT deadlocks AS n FROM pg_stat_database WHERE datname = current_database()"
    )


def tenant_counts(stack: Stack, shop: Shop) -> dict[str, int]:
    params = {"t": shop.tenant_id}
    tables = {
        "receipts": "payment_event_receipts",
        "transitions": "payment_order_transitions",
        "outbox": "payment_outbox",
        "exceptions": "payment_exceptions",
        "anomalies": "security_anomalies",
    }
    return {
        name: stack.count(
            f"SELECT count(*) AS n FROM payhook.{table} WHERE tenant_id = %(t)s", params
        )
        for name, table in tables.items()
    }


def assert_one_effect(stack: Stack, shop: Shop, event: StandardEvent) -> None:
    """One receipt, one transition, one outbox row, one fulfilment key at the receiver."""
    assert tenant_counts(stack, shop) == {
        "receipts": 1,
        "transitions": 1,
        "outbox": 1,
        "exceptions": 0,
        "anomalies": 0,
    }
    assert stack.receiver.keys().count(fulfil_key(shop, event)) == 1


def test_duplicate_storm_across_two_ingresses_has_one_effect(stack: Stack) -> None:
    shop = stack.shop()
    stack.order(shop, "storm-1", "pi_storm")
    event = StandardEvent(merchant_reference="storm-1", gateway_order_id="pi_storm")
    before = deadlocks(stack)
    with ThreadPoolExecutor(20) as pool:
        statuses = list(
            pool.map(lambda i: send(stack.url(shop, i % 2), event, shop.secret), range(20))
        )
    assert statuses == [202] * 20
    took = stack.settle(timeout=30)
    wait_until(lambda: fulfil_key(shop, event) in stack.receiver.keys(), 10, "the fulfilment")
    print(f"duplicate storm settled in {took:.1f}s")
    assert_one_effect(stack, shop, event)
    assert deadlocks(stack) == before
    assert stack.failed_jobs() == 0


def test_amount_mismatch_fulfils_nothing(stack: Stack) -> None:
    shop = stack.shop()
    stack.order(shop, "mismatch-1", "pi_mismatch", amount=5000)
    event = StandardEvent(
        merchant_reference="mismatch-1", gateway_order_id="pi_mismatch", amount=50
    )
    assert send(stack.url(shop), event, shop.secret) == 202
    stack.settle(timeout=30)
    assert tenant_counts(stack, shop) == {
        "receipts": 1,
        "transitions": 0,
        "outbox": 0,
        "exceptions": 1,
        "anomalies": 0,
    }
    state = stack.count(
        "SELECT count(*) AS n FROM payhook.payment_orders"
        " WHERE tenant_id = %(t)s AND state = 'pending'",
        {"t": shop.tenant_id},
    )
    assert state == 1
    assert not any(k.startswith(shop.tenant_id) for k in stack.receiver.keys())


def test_consumer_killed_after_commit_then_redelivery_has_one_effect(stack: Stack) -> None:
    shop = stack.shop()
    stack.order(shop, "crash-1", "pi_crash")
    event = StandardEvent(merchant_reference="crash-1", gateway_order_id="pi_crash")
    healthy = list(stack.consumers)
    for proc in healthy:
        stop(proc)
    stack.consumers.clear()
    doomed = stack.start_consumer(PAYHOOK_FAULTS="consumer_kill_after_commit")
    assert send(stack.url(shop), event, shop.secret) == 202
    assert doomed.wait(timeout=30) == -signal.SIGKILL
    stop(doomed)  # the whole process group, as a container kill would
    stack.consumers.remove(doomed)
    assert tenant_counts(stack, shop)["transitions"] == 1, "the transaction had committed"

    # The gateway redelivers the same event, as gateways do.
    assert send(stack.url(shop, 1), event, shop.secret) == 202
    for _ in range(3):
        stack.start_consumer()
    took = stack.settle(timeout=120)
    wait_until(lambda: fulfil_key(shop, event) in stack.receiver.keys(), 10, "the fulfilment")
    print(f"abandoned job recovered and redelivery settled in {took:.1f}s")
    assert_one_effect(stack, shop, event)


def test_bad_input_at_the_door_is_refused_and_writes_nothing(stack: Stack) -> None:
    shop = stack.shop()
    good = []
    for i in range(10):
        stack.order(shop, f"door-{i}", f"pi_door_{i}")
        good.append(StandardEvent(merchant_reference=f"door-{i}", gateway_order_id=f"pi_door_{i}"))
    url = stack.url(shop)

    def post(body: bytes, headers: dict[str, str], target: str = url) -> int:
        return httpx.post(target, content=body, headers=headers, timeout=10).status_code

    def bad_requests() -> list[tuple[int, int]]:
        e = StandardEvent(merchant_reference="door-0", gateway_order_id="pi_door_0")
        body = e.body()
        signed = e.headers(shop.secret, body)
        stale = StandardEvent(timestamp=int(time.time()) - 3600)
        wrong = e.headers("whsec_" + "A" * 43 + "=", body)
        huge = b"{" + b" " * (300 * 1024) + b"}"
        return [
            (post(body, {}), 400),
            (post(body, {k: v for k, v in signed.items() if k != "webhook-signature"}), 400),
            (post(body, signed | {"webhook-timestamp": "yesterday"}), 400),
            (post(stale.body(), stale.headers(shop.secret)), 401),
            (post(body, wrong), 401),
            (post(body.replace(b"1999", b"1"), signed), 401),
            (post(huge, e.headers(shop.secret, huge)), 413),
            (
                post(
                    body,
                    signed,
                    url.replace(shop.endpoint_id, "00000000-0000-4000-8000-000000000000"),
                ),
                404,
            ),
        ]

    with ThreadPoolExecutor(8) as pool:
        good_results = pool.map(lambda e: send(url, e, shop.secret), good)
        bad_results = [r for _ in range(5) for r in bad_requests()]
        assert list(good_results) == [202] * 10
    assert [got for got, _ in bad_results] == [want for _, want in bad_results]
    stack.settle(timeout=30)
    assert tenant_counts(stack, shop) == {
        "receipts": 10,
        "transitions": 10,
        "outbox": 10,
        "exceptions": 0,
        "anomalies": 0,
    }


def test_refund_before_its_payment_is_kept_then_applied_exactly_once(stack: Stack) -> None:
    shop = stack.shop()
    stack.order(shop, "late-1", "pi_late", amount=3000)
    refund = StandardEvent(
        type="payment.refunded",
        merchant_reference="late-1",
        gateway_order_id="pi_late",
        amount=1000,
    )
    payment = StandardEvent(merchant_reference="late-1", gateway_order_id="pi_late", amount=3000)
    assert send(stack.url(shop), refund, shop.secret) == 202
    stack.settle(timeout=30)
    with stack.db() as conn:
        row = conn.execute(
            "SELECT id, kind FROM payhook.payment_exceptions WHERE tenant_id = %s",
            (shop.tenant_id,),
        ).fetchone()
    assert row is not None and row["kind"] == "invalid_transition", "not silently dropped"
    assert tenant_counts(stack, shop)["transitions"] == 0

    # The payment arrives; the consumer that applies it replays the refund.
    assert send(stack.url(shop, 1), payment, shop.secret) == 202
    stack.settle(timeout=30)
    refund_key = f"{shop.tenant_id}:{refund.event_id}:notify_refund"
    wait_until(lambda: refund_key in stack.receiver.keys(), 10, "the refund notification")

    # An operator's replay, and the gateway's redelivery of the refund, change nothing.
    replay = subprocess.run(
        [sys.executable, "-m", "control.cli", "exceptions", "replay", str(row["id"])],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert replay.returncode == 0, replay.stderr
    assert send(stack.url(shop), refund, shop.secret) == 202
    stack.settle(timeout=30)
    counts = tenant_counts(stack, shop)
    assert counts["transitions"] == 2 and counts["outbox"] == 2
    assert stack.receiver.keys().count(refund_key) == 1
    with stack.db() as conn:
        order = conn.execute(
            "SELECT state, refunded_minor FROM payhook.payment_orders WHERE tenant_id = %s",
            (shop.tenant_id,),
        ).fetchone()
        still_open = conn.execute(
            "SELECT count(*) AS n FROM payhook.payment_exceptions"
            " WHERE tenant_id = %s AND resolved_at IS NULL",
            (shop.tenant_id,),
        ).fetchone()
    assert order == {"state": "partially_refunded", "refunded_minor": 1000}
    assert still_open == {"n": 0}


def test_ingress_killed_after_enqueue_before_answering_then_retry_has_one_effect(
    stack: Stack,
) -> None:
    shop = stack.shop()
    stack.order(shop, "lost-ack-1", "pi_lost_ack")
    event = StandardEvent(merchant_reference="lost-ack-1", gateway_order_id="pi_lost_ack")
    port = stack.start_ingress(PAYHOOK_FAULTS="ingress_kill_after_enqueue")
    doomed, _ = stack.ingress.pop()
    url = f"http://127.0.0.1:{port}/webhooks/{shop.endpoint_id}"
    assert send(url, event, shop.secret) == 0, "the gateway saw no answer"
    assert doomed.wait(timeout=10) == -signal.SIGKILL
    stop(doomed)
    # The gateway retries what it never saw acknowledged, here through another instance.
    assert send(stack.url(shop), event, shop.secret) == 202
    stack.settle(timeout=30)
    wait_until(lambda: fulfil_key(shop, event) in stack.receiver.keys(), 10, "the fulfilment")
    assert_one_effect(stack, shop, event)
    with stack.db() as conn:
        row = conn.execute(
            "SELECT outcome FROM payhook.payment_event_receipts WHERE tenant_id = %s",
            (shop.tenant_id,),
        ).fetchone()
    assert row == {"outcome": "applied"}
    outcomes = Counter(
        json.loads(line)["outcome"]
        for log in stack.logs.glob("consumer-*.log")
        for line in log.read_text().splitlines()
        if event.event_id in line and '"event_applied"' in line
    )
    assert outcomes == {"applied": 1, "duplicate": 1}, "both jobs ran: the first was queued"


# -- batched gateways -----------------------------------------------------------------

GOCARDLESS_TOKEN = "e2e_read_only"


def batch_keys(shop: Shop, event_ids: list[str]) -> set[str]:
    return {f"{shop.tenant_id}:{event_id}:fulfil_order" for event_id in event_ids}


def assert_one_effect_each(stack: Stack, shop: Shop, event_ids: list[str]) -> None:
    """Per event: one receipt, transition, outbox row and fulfilment key."""
    n = len(event_ids)
    assert tenant_counts(stack, shop) == {
        "receipts": n,
        "transitions": n,
        "outbox": n,
        "exceptions": 0,
        "anomalies": 0,
    }
    keys = [k for k in stack.receiver.keys() if k.startswith(shop.tenant_id)]
    assert sorted(keys) == sorted(batch_keys(shop, event_ids))


def test_duplicate_storm_of_a_batched_webhook_has_one_effect_per_event(stack: Stack) -> None:
    """GoCardless: one signed webhook of 5 events, delivered 20 times at once
    across both ingresses; every event's payment read from the (local) API."""
    with FakeApi(GOCARDLESS_TOKEN).running() as api:
        config = Config({"api_base_url": api.url}, {"access_token": GOCARDLESS_TOKEN})
        shop = stack.shop("gocardless", config)
        events = []
        for i in range(5):
            stack.order(shop, f"gc-storm-{i}", f"PM_STORM_{i}", 1999, "GBP")
            api.add("payments", {"id": f"PM_STORM_{i}", "amount": 1999, "currency": "GBP"})
            events.append(
                {
                    "id": f"EV_STORM_{i}",
                    "created_at": "2026-12-01T10:00:00.000Z",
                    "resource_type": "payments",
                    "action": "confirmed",
                    "links": {"payment": f"PM_STORM_{i}"},
                }
            )
        body = json.dumps({"events": events, "meta": {"webhook_id": "WB_STORM"}}).encode()
        headers = {"webhook-signature": gocardless.sign(shop.secret, body)}
        with ThreadPoolExecutor(20) as pool:
            statuses = list(
                pool.map(lambda i: post(stack.url(shop, i % 2), body, headers), range(20))
            )
        assert statuses == [204] * 20
        took = stack.settle(timeout=60)
    ids = [str(e["id"]) for e in events]
    wait_until(lambda: batch_keys(shop, ids) <= set(stack.receiver.keys()), 10, "the fulfilments")
    print(f"batched duplicate storm (5 events x 20) settled in {took:.1f}s")
    assert_one_effect_each(stack, shop, ids)
    assert stack.failed_jobs() == 0


def test_consumer_killed_after_commit_mid_batch_then_redelivery_has_one_effect_each(
    stack: Stack,
) -> None:
    """Adyen: a notification of 3 items; the only consumer is SIGKILLed right
    after the first item's commit, the others still queued; Adyen redelivers
    the whole notification."""
    shop = stack.shop("adyen")
    samples = []
    for i in range(3):
        psp = f"88355112106{i:05d}"
        stack.order(shop, f"adyen-crash-{i}", psp)
        samples.append(psp)
    first = SendEvent("adyen", "AUTHORISATION", samples[0], 1999, "EUR")
    request = sign_event(first, shop.secret)
    notification = json.loads(request.body)
    item = notification["notificationItems"][0]["NotificationRequestItem"]
    items = []
    for psp in samples:
        one = dict(item, pspReference=psp, additionalData={})
        one["additionalData"]["hmacSignature"] = adyen.sign(shop.secret, one)
        items.append({"NotificationRequestItem": one})
    body = json.dumps({"live": "false", "notificationItems": items}).encode()

    for proc in list(stack.consumers):
        stop(proc)
    stack.consumers.clear()
    doomed = stack.start_consumer(PAYHOOK_FAULTS="consumer_kill_after_commit")
    assert post(stack.url(shop), body, {}) == 200
    assert doomed.wait(timeout=30) == -signal.SIGKILL
    stop(doomed)
    stack.consumers.remove(doomed)
    assert tenant_counts(stack, shop)["transitions"] >= 1, "a transaction had committed"

    assert post(stack.url(shop, 1), body, {}) == 200
    for _ in range(3):
        stack.start_consumer()
    took = stack.settle(timeout=120)
    ids = [f"AUTHORISATION:{psp}:true" for psp in samples]
    wait_until(lambda: batch_keys(shop, ids) <= set(stack.receiver.keys()), 10, "the fulfilments")
    print(f"batch after a crash mid-way settled in {took:.1f}s")
    assert_one_effect_each(stack, shop, ids)
