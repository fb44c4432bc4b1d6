"""Redis failover under load, through Sentinel: one master, two replicas and
three Sentinels of the test's own; every payhook process reaches Redis
through the Sentinels. Under a steady stream of signed events the master is
SIGKILLed; the Sentinels promote a replica, which the other follows; the
ingress answers 503 for a short window, then 202 again; the consumers find
the new master (started again if they exited, as a restart policy does).

With `PAYHOOK_ENQUEUE_REPLICAS=1` every event answered 202 ends as exactly
one receipt. Without it, the master's reply alone is the promise: a job it
wrote but had not yet sent to its replica is gone with it. Both runs print
what they saw (the 503s, the window, what was lost).
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.sentinels import SentinelGroup, online_replicas
from tests.e2e.stack import RedisServer, Stack
from tests.e2e.test_scenarios import send
from tests.factories import Shop, StandardEvent
from tests.processes import stop, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("redis_failover")]

#: Seconds the stream runs before the kill, and after it.
BEFORE, AFTER = 2.0, 10.0
#: Threads sending, each one event at a time, as a gateway's workers do.
SENDERS = 4


@pytest.fixture
def group_and_stack() -> Iterator[tuple[SentinelGroup, Stack]]:
    root = Path(tempfile.mkdtemp(prefix="payhook-failover-", dir="/tmp"))
    root.chmod(0o755)
    group = SentinelGroup(root)
    group.start()
    stack = Stack(root, extra_env=group.env(), own_redis=False)
    try:
        yield group, stack.start(ingresses=2, consumers=2, outbox_workers=1)
    finally:
        stack.stop()
        group.stop()
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Stream:
    """What a gateway saw: each event's first 2xx, and every 503 with its time."""

    acknowledged: list[str] = field(default_factory=list)
    #: When each acknowledgement arrived (monotonic), in the same order.
    acknowledged_at: list[float] = field(default_factory=list)
    refused_at: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def stream(stack: Stack, shop: Shop, stop_at: threading.Event, out: Stream) -> None:
    """Send new events until told to stop; retry each until acknowledged
    (for a minute at most: then the test fails on what it counts)."""
    while not stop_at.is_set():
        event = StandardEvent(merchant_reference=None, gateway_order_id="pi_failover")
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            status = send(stack.url(shop), event, shop.secret)
            if status == 202:
                with out.lock:
                    out.acknowledged.append(event.event_id)
                    out.acknowledged_at.append(time.monotonic())
                break
            with out.lock:
                out.refused_at.append(time.monotonic())
            time.sleep(0.05)
        time.sleep(0.01)


def restart_ingresses(stack: Stack, **env: str) -> None:
    for proc, _ in stack.ingress:
        stop(proc)
    stack.ingress.clear()
    for _ in range(2):
        stack.start_ingress(**env)


@dataclass
class Failover:
    """When the master was killed, and how long after it a replica was
    promoted and the other followed it (seconds)."""

    killed_at: float
    promoted: float
    following: float


def fail_over(group: SentinelGroup, stack: Stack, shop: Shop) -> tuple[Stream, Failover, int]:
    """Stream, SIGKILL the master, wait for the promotion and for the other
    replica to follow the new master, stream on. A consumer waiting for a job
    when the master goes reconnects through the Sentinels; one caught in RQ's
    bookkeeping exits, and is started again as compose and Kubernetes do."""
    with stack.supervised():
        return _fail_over(group, stack, shop)


def _fail_over(group: SentinelGroup, stack: Stack, shop: Shop) -> tuple[Stream, Failover, int]:
    out, stop_at = Stream(), threading.Event()
    senders = [
        threading.Thread(target=stream, args=(stack, shop, stop_at, out), daemon=True)
        for _ in range(SENDERS)
    ]
    for t in senders:
        t.start()
    time.sleep(BEFORE)
    old = group.master()
    killed_at = time.monotonic()
    old.kill(signal.SIGKILL)
    wait_until(lambda: group.master_port() not in (None, old.port), 30, "the promotion")
    promoted = time.monotonic() - killed_at
    new = group.master()
    wait_until(lambda: group.replicas_of(new) >= 1, 30, "the other replica to follow")
    following = time.monotonic() - killed_at
    time.sleep(AFTER)
    stop_at.set()
    for t in senders:
        t.join(timeout=60)
    took = stack.settle(timeout=180)
    return out, Failover(killed_at, promoted, following), int(took)


def report(out: Stream, failover: Failover, took: int) -> str:
    last = max(out.refused_at) - failover.killed_at if out.refused_at else 0.0
    return (
        f"{len(out.acknowledged)} acknowledged, {len(out.refused_at)} answered 503, the last "
        f"{last:.1f} s after the kill; a replica promoted after {failover.promoted:.1f} s, "
        f"the other following it after {failover.following:.1f} s; settled in {took} s"
    )


def assert_acknowledging_again(out: Stream, failover: Failover) -> None:
    """The ingress answered 202 again once a replica was promoted: it found the new master."""
    promoted_at = failover.killed_at + failover.promoted
    assert any(at > promoted_at for at in out.acknowledged_at), "no 202 after the promotion"


def receipts(stack: Stack) -> list[str]:
    with stack.db() as conn:
        rows = conn.execute("SELECT event_id FROM payhook.payment_event_receipts").fetchall()
    return [r["event_id"] for r in rows]


def test_with_one_replica_every_acknowledged_event_survives_the_failover(
    group_and_stack: tuple[SentinelGroup, Stack],
) -> None:
    group, stack = group_and_stack
    shop = stack.shop()
    restart_ingresses(stack, PAYHOOK_ENQUEUE_REPLICAS="1")
    out, failover, took = fail_over(group, stack, shop)
    print(f"failover with PAYHOOK_ENQUEUE_REPLICAS=1: {report(out, failover, took)}")
    assert out.refused_at, "the ingress refused while there was no master"
    assert_acknowledging_again(out, failover)
    seen = receipts(stack)
    assert len(set(seen)) == len(seen)
    assert set(out.acknowledged) <= set(seen), "every acknowledged event has its receipt"


def test_without_replicas_the_loss_is_counted(
    group_and_stack: tuple[SentinelGroup, Stack],
) -> None:
    group, stack = group_and_stack
    shop = stack.shop()
    out, failover, took = fail_over(group, stack, shop)
    seen = receipts(stack)
    lost = set(out.acknowledged) - set(seen)
    print(f"failover without WAIT: {len(lost)} lost; {report(out, failover, took)}")
    # What was not lost was applied once.
    assert len(set(seen)) == len(seen)
    assert_acknowledging_again(out, failover)


def test_a_202_waits_for_the_replicas_it_is_told_to() -> None:
    """With PAYHOOK_ENQUEUE_REPLICAS=1 the ingress answers 202 once a replica
    holds the job, and 503 while none does; its job may still be in the
    master, and the gateway's retry of it is a duplicate."""
    tmp_path = Path(tempfile.mkdtemp(prefix="payhook-wait-", dir="/tmp"))
    tmp_path.chmod(0o755)  # PostgreSQL runs as its own user
    master, replica = RedisServer(tmp_path, "master"), RedisServer(tmp_path, "replica")
    master.start()
    replica.start(replica_of=master.port)
    wait_until(lambda: online_replicas(master.port) == 1, 20, "the replica to sync")
    stack = Stack(
        tmp_path,
        extra_env={"REDIS_URL": f"redis://127.0.0.1:{master.port}/0"},
        own_redis=False,
    )
    try:
        stack.start(ingresses=1, consumers=1, outbox_workers=0)
        restart_ingresses(stack, PAYHOOK_ENQUEUE_REPLICAS="1", PAYHOOK_ENQUEUE_TIMEOUT="1s")
        shop = stack.shop()
        held = StandardEvent(merchant_reference=None, gateway_order_id="pi_held")
        assert send(stack.url(shop), held, shop.secret) == 202
        replica.kill(signal.SIGKILL)
        alone = StandardEvent(merchant_reference=None, gateway_order_id="pi_alone")
        assert send(stack.url(shop), alone, shop.secret) == 503
        assert send(stack.url(shop), alone, shop.secret) == 503
        replica.start(replica_of=master.port)
        wait_until(lambda: online_replicas(master.port) == 1, 20, "the replica to sync")
        assert send(stack.url(shop), alone, shop.secret) == 202
        # An ingress whose Redis is a replica (a master demoted under it) is
        # answered READONLY: 503, never 202, and nothing is queued.
        port = stack.start_ingress(REDIS_URL=f"redis://127.0.0.1:{replica.port}/0")
        demoted = StandardEvent(merchant_reference=None, gateway_order_id="pi_demoted")
        url = f"http://127.0.0.1:{port}/webhooks/{shop.endpoint_id}"
        assert send(url, demoted, shop.secret) == 503
        stack.settle(timeout=60)
        assert sorted(receipts(stack)) == sorted([held.event_id, alone.event_id])
    finally:
        stack.stop()
        master.kill(signal.SIGTERM)
        replica.kill(signal.SIGTERM)
        shutil.rmtree(tmp_path, ignore_errors=True)
