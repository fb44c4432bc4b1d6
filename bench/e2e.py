"""The whole stack end to end, beside stock RQ's no-op ceiling measured in the same run.

    python -m bench.e2e [--consumers 2] [--step 10] [--hold 60] [--latency 30]
                        [--fsync always|everysec|no] [--memory-events N]

A real ingress (one process), consumers and an outbox worker, against a local
receiver (`tests/receiver.py`), on this machine; Redis private, with the
persistence of compose (`appendfsync always`). A load process posts signed
Standard Webhooks events open loop, each paying an order, at a fixed rate.

1. Stock RQ's no-op ceiling: `rq.SimpleWorker` running no-op jobs of the same
   shape, as many workers as consumers.
2. The sustained rate: rates rise step by step (`--step` seconds each) until
   the backlog (jobs queued or running, outbox rows undelivered) grows past
   a second's worth; the last rate that kept up is then held `--hold`
   seconds, and must keep up again (else 15% less is tried). Printed in
   events per second delivered to the receiver over the hold.
3. Latency from the ingress accepting a webhook (its 2xx, at the load
   process) to the receiver getting the fulfilment call: p50, p99 and max, at
   half the sustained rate and at 10 events/s.
4. Memory: each consumer's largest RSS over the run, and the PSS of it and
   its RQ scheduler child together; with `--memory-events N`,
   N more events at half the sustained rate first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from redis import Redis

from bench.consumer import Meters, fresh_settings, make_events, run_workers
from bench.loadgen import Sent, post_open_loop, render
from bench.services import (
    FSYNC_CHOICES,
    cpu_seconds,
    parent_pid,
    private_redis,
    server_cpu_seconds,
    spare_port,
    wait_for_port,
)
from control import admin
from payhook.db import connect
from payhook.queue import events_queue
from payhook.settings import Settings
from tests.factories import LOCAL_RECEIVER_SETTINGS, LOCAL_RECEIVERS, TEST_KEYRING, StandardEvent
from tests.processes import process_env
from tests.receiver import Receiver

#: Rates tried in turn, events per second, until one does not keep up.
LADDER = (
    *(20, 40, 60, 80, 100, 125, 150, 175, 200, 240, 280, 330, 400, 480, 560, 650, 750),
    *(870, 1000, 1150, 1300, 1500, 1700, 2000, 2300, 2600, 3000),
)
#: Seconds of work a backlog may hold and still count as keeping up.
BACKLOG_SECONDS = 1.0
#: Seconds the stack gets after a step to drain what is in flight.
SETTLE = 3.0
#: Orders made for the load, at most (one per event).
MAX_ORDERS = 400_000


@dataclass
class Stack:
    settings: Settings
    url: str
    secret: str
    tenant_id: str
    receiver: Receiver
    consumers: list[subprocess.Popen[bytes]]
    #: Processes whose CPU a hold is charged with, by kind.
    meters: dict[str, list[int]]
    next_order: int = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--step", type=float, default=10.0, help="seconds per rate tried")
    parser.add_argument("--hold", type=float, default=60.0, help="seconds the rate is held")
    parser.add_argument("--latency", type=float, default=30.0, help="seconds per latency run")
    parser.add_argument("--fsync", choices=FSYNC_CHOICES, default="always")
    parser.add_argument("--memory-events", type=int, default=0)
    args = parser.parse_args()
    with private_redis(args.fsync) as (redis_url, redis_pid):
        run(args, redis_url, redis_pid)


def run(args: argparse.Namespace, redis_url: str, redis_pid: int) -> None:
    settings = fresh_settings(redis_url)
    redis = Redis.from_url(redis_url)
    _, envelopes = make_events(settings, 1000)
    stock = run_workers(
        settings, redis, envelopes, "noop", "stock", args.consumers, Meters(None, None)
    )
    redis.flushdb()
    print(
        f"end-to-end benchmark: {os.cpu_count()} cores, 1 ingress, {args.consumers} consumers, "
        f"1 outbox worker, Redis appendfsync={args.fsync}"
    )
    print(f"  stock RQ SimpleWorker, no-op jobs   {stock.rate:8.0f} jobs/s   (ceiling)")
    with running_stack(settings, args.consumers) as stack:
        memory = Memory()
        stack.meters["Redis"] = [redis_pid]
        sustained, delivered, cpu = hold(
            stack, redis, find_sustained(stack, redis, args, memory), args.hold, memory
        )
        print(
            f"  sustained {args.hold:.0f} s, queue not growing  {delivered:8.0f} events/s "
            f"delivered   ({delivered / stock.rate:.2f}x the ceiling; offered {sustained}/s)"
        )
        total = sum(cpu.values())
        print(
            "  CPU per event over that hold, µs: "
            + ", ".join(f"{name} {us:,.0f}" for name, us in cpu.items())
            + f"; all {total:,.0f} (the {os.cpu_count()} cores alone would allow "
            f"{(os.cpu_count() or 1) * 1e6 / total:,.0f} events/s)"
        )
        for rate in (max(1, sustained // 2), 10):
            latencies = latency_run(stack, redis, rate, args.latency, memory)
            print(
                f"  accepted -> fulfilment call at {rate:>3}/s  p50 {latencies[0]:6.1f} ms  "
                f"p99 {latencies[1]:6.1f} ms  max {latencies[2]:6.1f} ms"
            )
        if args.memory_events:
            rate = max(1, sustained // 2)
            offer(stack, rate, args.memory_events / rate, memory)
            drain(stack, redis, timeout=600)
        sent = stack.next_order
        print(
            f"  each consumer's largest RSS over the run ({sent:,} events): "
            + ", ".join(f"{mib:.0f} MiB" for mib in memory.rss.values())
            + "; with its RQ scheduler child, PSS: "
            + ", ".join(f"{mib:.0f} MiB" for mib in memory.pss.values())
        )


@contextmanager
def running_stack(settings: Settings, consumers: int) -> Iterator[Stack]:
    folder = Path(tempfile.mkdtemp(prefix="payhook-bench-e2e-"))
    with Receiver(folder / "receiver") as receiver:
        with connect(settings) as conn:
            tenant = admin.add_tenant(
                conn, "e2e", receiver.url, keyring=TEST_KEYRING, destinations=LOCAL_RECEIVERS
            )
            endpoint = admin.add_endpoint(conn, tenant, "standard", keyring=TEST_KEYRING)
        with connect(settings, owner=True) as conn:
            conn.execute(
                "INSERT INTO payhook.payment_orders (tenant_id, id, merchant_reference,"
                " gateway_order_id, amount_minor, currency)"
                " SELECT %s, gen_random_uuid(), 'e2e-' || i, 'pi_e2e_' || i, 1500, 'EUR'"
                " FROM generate_series(0, %s) AS i",
                (tenant, MAX_ORDERS - 1),
            )
            conn.execute("ANALYZE payhook.payment_orders")
        env = process_env(settings, PAYHOOK_LOG_LEVEL="WARNING", **LOCAL_RECEIVER_SETTINGS)
        port = spare_port()
        procs = [
            _start(["ingress", "--port", str(port)], env, folder / "ingress.log"),
            _start(["outbox-worker"], env, folder / "outbox.log"),
        ]
        workers = [
            _start(["consumer"], env, folder / f"consumer-{i}.log") for i in range(consumers)
        ]
        with connect(settings) as conn:
            row: Any = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()
            postmaster = parent_pid(row["pid"])  # while the backend is alive
        assert receiver.process is not None and postmaster is not None
        meters = {
            "ingress": [procs[0].pid],
            "consumers": [w.pid for w in workers],
            "outbox worker": [procs[1].pid],
            "receiver": [receiver.process.pid],
            "PostgreSQL": [postmaster],
        }
        try:
            wait_for_port(port)
            _wait_ready(port)
            yield Stack(
                settings,
                f"http://127.0.0.1:{port}/webhooks/{endpoint.endpoint_id}",
                endpoint.secret,
                tenant,
                receiver,
                workers,
                meters,
            )
        finally:
            for proc in [*procs, *workers]:
                proc.terminate()
            for proc in [*procs, *workers]:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "control.cli", *args], env=env, stdout=out, stderr=out
        )


def _wait_ready(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("the ingress did not become ready")


def backlog(stack: Stack, redis: Redis) -> int:
    """Work not yet done: jobs queued, taken or running, outbox rows undelivered."""
    queue = events_queue(redis, stack.settings)
    jobs = queue.count + int(redis.llen(queue.intermediate_queue_key))
    jobs += queue.started_job_registry.get_job_count(cleanup=False)
    with connect(stack.settings, owner=True) as conn:
        row: Any = conn.execute(
            "SELECT count(*) AS n FROM payhook.payment_outbox WHERE state = 'pending'"
        ).fetchone()
    return int(jobs) + int(row["n"])


def find_sustained(stack: Stack, redis: Redis, args: argparse.Namespace, memory: Memory) -> int:
    """The highest rate of the ladder the stack keeps up with for a step."""
    kept = LADDER[0]
    for rate in LADDER:
        result = offer(stack, rate, args.step, memory)
        time.sleep(SETTLE)
        left = backlog(stack, redis)
        keeping_up = result.refused == 0 and left <= rate * BACKLOG_SECONDS
        print(
            f"    {rate:>4}/s for {args.step:.0f} s: sent at {result.sent_rate:.0f}/s "
            f"(lag {result.lag * 1000:.0f} ms), {result.accepted} accepted, "
            f"{result.refused} refused, backlog {left} {'' if keeping_up else '(falls behind)'}"
        )
        drain(stack, redis)
        if not result.offered(rate):
            print("    the load process cannot offer more: the ladder stops here")
            break
        if not keeping_up:
            break
        kept = rate
    return kept


def hold(
    stack: Stack, redis: Redis, rate: int, seconds: float, memory: Memory
) -> tuple[int, float, dict[str, float]]:
    """Hold `rate` for `seconds`, stepping down 15% until it keeps up; the
    rate held, the rate delivered to the receiver over the hold, and the CPU
    each kind of process spent per event until all of it was delivered."""
    while True:
        before = len(stack.receiver.requests())
        cpu_before = _stack_cpu(stack)
        result = offer(stack, rate, seconds, memory)
        time.sleep(SETTLE)
        left = backlog(stack, redis)
        if not result.offered(rate):
            print(f"    {rate}/s held: sent at {result.sent_rate:.0f}/s only; 15% less")
        elif result.refused == 0 and left <= rate * BACKLOG_SECONDS:
            drain(stack, redis)
            cpu_after = _stack_cpu(stack)
            events = len(result.accepted_at)
            cpu = {k: (cpu_after[k] - cpu_before[k]) * 1e6 / events for k in cpu_before}
            cpu["load process"] = result.cpu * 1e6 / events
            # Delivered over the hold's window, from its first send.
            end = result.started + seconds
            delivered = [r for r in stack.receiver.requests()[before:] if r["t"] <= end]
            return rate, len(delivered) / seconds, cpu
        else:
            print(f"    {rate}/s held {seconds:.0f} s falls behind ({left} to do); 15% less")
        drain(stack, redis)
        rate = int(rate * 0.85)


def _stack_cpu(stack: Stack) -> dict[str, float]:
    """CPU seconds each kind of the stack's processes has used so far."""
    totals = {}
    for name, pids in stack.meters.items():
        if name == "PostgreSQL":
            totals[name] = sum(server_cpu_seconds(pid) for pid in pids)
        else:
            totals[name] = sum(_family_cpu(pid) for pid in pids)
    return totals


def _family_cpu(pid: int) -> float:
    """A process's CPU seconds with its live and reaped children's (a
    consumer's RQ scheduler)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        children = []
    return cpu_seconds(pid, reaped_children=True) + sum(cpu_seconds(c.pid) for c in children)


def drain(stack: Stack, redis: Redis, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while backlog(stack, redis) and time.monotonic() < deadline:
        time.sleep(0.5)


@dataclass
class Offered:
    accepted: int
    refused: int
    #: Each accepted event: its id and when its 2xx arrived (wall clock).
    accepted_at: dict[str, float]
    #: The rate the load process sent at, and the latest a send ran behind.
    sent_rate: float
    lag: float
    #: When the first event was sent (wall clock).
    started: float
    #: CPU seconds the load process spent sending.
    cpu: float

    def offered(self, rate: int) -> bool:
        """Whether the load process did offer `rate` (it may not keep up
        itself): sent within 2% of it, no send over a second late."""
        return self.sent_rate >= 0.98 * rate and self.lag < 1.0


def offer(stack: Stack, rate: int, seconds: float, memory: Memory) -> Offered:
    """Post `rate` events a second for `seconds`, open loop, from another process."""
    count = int(rate * seconds)
    first = stack.next_order
    stack.next_order += count
    if stack.next_order > MAX_ORDERS:
        raise SystemExit("out of orders: raise MAX_ORDERS")
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.SimpleQueue[Any] = context.SimpleQueue()
    proc = context.Process(
        target=_load, args=(stack.url, stack.secret, first, count, rate, results)
    )
    proc.start()
    # Read the result before joining: the load process exits only once its
    # result, larger than a pipe holds, is read.
    while results.empty():
        _sample_rss(stack, memory)
        if not proc.is_alive() and results.empty():
            raise SystemExit(f"the load process failed ({proc.exitcode})")
        time.sleep(0.5)
    sent: Sent = results.get()
    proc.join(timeout=30)
    rate_sent = count / max(sent.span, 1e-9)
    return Offered(
        len(sent.accepted),
        sent.refused,
        sent.accepted,
        rate_sent,
        sent.lag,
        sent.started,
        sent.cpu,
    )


@dataclass
class Memory:
    """Each consumer's largest memory, MiB: the process's RSS, and the PSS
    of the process and its children (RQ's scheduler, forked from it: their
    RSS would count the pages they share twice)."""

    rss: dict[int, float] = field(default_factory=dict)
    pss: dict[int, float] = field(default_factory=dict)


def _sample_rss(stack: Stack, memory: Memory) -> None:
    for proc in stack.consumers:
        try:
            process = psutil.Process(proc.pid)
            rss = process.memory_info().rss
            family = [process, *process.children(recursive=True)]
            pss = sum(p.memory_full_info().pss for p in family)
        except psutil.Error:
            continue
        memory.rss[proc.pid] = max(memory.rss.get(proc.pid, 0.0), rss / 2**20)
        memory.pss[proc.pid] = max(memory.pss.get(proc.pid, 0.0), pss / 2**20)


def _load(url: str, secret: str, first: int, count: int, rate: int, results: Any) -> None:
    """The load process: signed events, one every 1/rate s, each its own order."""
    requests = []
    for i in range(first, first + count):
        event = StandardEvent(
            gateway_order_id=f"pi_e2e_{i}", merchant_reference=f"e2e-{i}", amount=1500
        )
        body = event.body()
        requests.append((event.event_id, render(url, body, event.headers(secret, body))))
    results.put(asyncio.run(post_open_loop(url, requests, rate)))


def latency_run(
    stack: Stack, redis: Redis, rate: int, seconds: float, memory: Memory
) -> tuple[float, float, float]:
    """p50, p99 and max, in ms, from accepted to the receiver's fulfilment call."""
    before = len(stack.receiver.requests())
    result = offer(stack, rate, seconds, memory)
    drain(stack, redis)
    arrived: dict[str, float] = {}
    for request in stack.receiver.requests()[before:]:
        event_id = json.loads(request["body"]).get("event_id")
        arrived.setdefault(event_id, request["t"])
    latencies = sorted(
        (arrived[e] - t) * 1000 for e, t in result.accepted_at.items() if e in arrived
    )
    if len(latencies) < len(result.accepted_at):
        raise SystemExit(f"{len(result.accepted_at) - len(latencies)} fulfilments never arrived")
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return statistics.median(latencies), p99, latencies[-1]


if __name__ == "__main__":
    main()
