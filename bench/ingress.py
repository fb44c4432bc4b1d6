"""Ingress throughput and latency, beside a bare Starlette route in the same run.

    python -m bench.ingress [--seconds S] [--rounds R] [--connections C] [--rate N]
                            [--fsync always|everysec|no]

1. Throughput: wrk (Debian's `wrk`) drives one uvicorn worker of each app
   with the same signed ~1.5 KB bodies, rounds alternating: a bare Starlette
   route that reads the body and answers 202 (the ceiling), then the ingress
   (verify, enqueue to a real Redis, 202). Reported: the median of each and
   their ratio (goal: the ingress at 50% of the bare route or more), and the
   CPU each process spent per request, which a busy shared machine distorts
   less than requests per second.
2. Latency: an open-loop generator sends N requests per second (default
   1,000) to each app for S seconds; latency counts from each request's
   scheduled time, so a stall is not hidden by the sender waiting for it.
   Goal: ingress p99 below 10 ms. The bare route's figures show what the
   generator and the machine add on their own; beside each, how late the
   generator was to send, and for the ingress how many jobs its own
   histogram saw wait over 10 ms for Redis: a tail is then the generator's,
   Redis's, or the app's.
3. The enqueue step alone, 32 jobs at a time: RQ's own `enqueue_event` in a
   bounded thread pool (the obvious design) beside the ingress's batched
   redis.asyncio writer, CPU and wall time per job.

Both apps run as real processes; Redis is a private redis-server started here
with the persistence of compose.yaml (`appendfsync always`) unless --fsync
says otherwise, and the endpoint comes from a scratch PostgreSQL database.
Every response is checked: a run with any status but 202 fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from redis import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench.services import FSYNC_CHOICES, cpu_seconds, private_redis, process, spare_port
from control import admin
from control.migrations import apply_migrations
from ingress.enqueue import Enqueuer
from payhook.db import connect
from payhook.envelope import Envelope
from payhook.gateways import standard
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, TEST_SECRETS_KEY

PG = os.environ.get("PAYHOOK_BENCH_PG", "postgresql://postgres@127.0.0.1:5432")
DB = "payhook_bench_ingress"
#: Distinct signed events the load cycles through.
EVENTS = 2000
#: Body size the issue asks for, in bytes.
BODY_SIZE = 1500


async def bare_route(request: Request) -> Response:
    await request.body()
    return Response(b'{"delivery_id": "bare"}', status_code=202, media_type="application/json")


#: The ceiling: a route that reads the body and answers 202, nothing else.
bare_app = Starlette(routes=[Route("/webhooks/{endpoint_id}", bare_route, methods=["POST"])])


@contextmanager
def scratch_endpoint(redis_url: str, db: str = DB) -> Iterator[tuple[Settings, str, str]]:
    """Settings on a fresh database `db` holding one tenant and one standard endpoint."""
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
    settings = Settings.from_env(
        {
            "DATABASE_URL": f"{PG}/{db}",
            "REDIS_URL": redis_url,
            "PAYHOOK_QUEUE": "payhook-bench",
            "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
        }
    )
    try:
        apply_migrations(settings)
        with connect(settings) as conn:
            tenant = admin.add_tenant(conn, "bench", keyring=TEST_KEYRING)
            endpoint = admin.add_endpoint(conn, tenant, "standard", keyring=TEST_KEYRING)
        yield settings, endpoint.endpoint_id, endpoint.secret
    finally:
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db))
            )


def signed_requests(secret: str, count: int) -> list[tuple[bytes, dict[str, str]]]:
    """`count` distinct payment events of about BODY_SIZE bytes, signed now."""
    requests = []
    timestamp = int(time.time())
    for i in range(count):
        event_id = f"msg_{uuid.uuid4().hex}"
        payload: dict[str, Any] = {
            "type": "payment.succeeded",
            "timestamp": "2026-11-30T00:00:00+00:00",
            "data": {
                "gateway_order_id": f"pi_{uuid.uuid4().hex[:24]}",
                "merchant_reference": f"order-{i}",
                "amount": 1500 + i,
                "currency": "EUR",
                "customer": {"email": f"customer{i}@example.com", "country": "NL"},
                "lines": [],
            },
        }
        # Line items with ids until the body is BODY_SIZE bytes: as varied (and as
        # hard to compress) as a real event, unlike padding.
        lines: list[dict[str, object]] = payload["data"]["lines"]
        while len(body := json.dumps(payload).encode()) < BODY_SIZE - 30:
            n = len(lines)
            lines.append({"sku": uuid.uuid4().hex[:12], "qty": n % 3 + 1, "price": 250 + n * 7})
        headers = {
            "webhook-id": event_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": standard.sign(secret, event_id, timestamp, body),
            "content-type": "application/json",
        }
        requests.append((body, headers))
    return requests


def wrk_script(
    path: str,
    requests: list[tuple[bytes, dict[str, str]]],
    folder: Path,
    name: str = "requests",
    success: str = "status == 202",
) -> Path:
    """A wrk Lua script cycling through the pre-signed requests, counting
    answers other than `success` (a Lua condition on `status`)."""
    lines = ["local requests = {}"]
    for body, headers in requests:
        header_table = ", ".join(f"[{_lua(k)}] = {_lua(v)}" for k, v in headers.items())
        lines.append(
            f"table.insert(requests, wrk.format('POST', {_lua(path)}, "
            f"{{{header_table}}}, {_lua(body.decode())}))"
        )
    lines += [
        "local i = 0",
        "request = function() i = i % #requests + 1; return requests[i] end",
        "local bad = 0",
        f"response = function(status) if not ({success}) then bad = bad + 1 end end",
        "done = function() io.write(string.format('non202 %d\\n', bad)) end",
    ]
    script = folder / f"{name}.lua"
    script.write_text("\n".join(lines) + "\n")
    return script


def _lua(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Lua string literal for ASCII text


@dataclass
class Round:
    rps: float
    requests: int
    #: CPU microseconds per request, of each process watched.
    cpu_us: dict[str, float]


def measure(
    port: int, script: Path, seconds: int, connections: int, watched: dict[str, int]
) -> Round:
    """One wrk round, with the CPU each watched process spent per request."""
    before = {name: cpu_seconds(pid) for name, pid in watched.items()}
    rps, requests = run_wrk(port, script, seconds, connections)
    spent = {name: cpu_seconds(pid) - before[name] for name, pid in watched.items()}
    return Round(rps, requests, {name: cpu / requests * 1e6 for name, cpu in spent.items()})


def run_wrk(port: int, script: Path, seconds: int, connections: int) -> tuple[float, int]:
    """Requests per second and requests of one wrk run; raises if any was not a 202."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script),
         f"http://127.0.0.1:{port}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    bad = next(int(line.split()[1]) for line in out.splitlines() if line.startswith("non202"))
    errors = [line for line in out.splitlines() if "Non-2xx" in line or "Socket errors" in line]
    if bad or errors:
        raise RuntimeError(f"wrk saw failures: non202={bad} {errors}")
    rps = float(next(line.split()[1] for line in out.splitlines() if "Requests/sec" in line))
    requests = int(next(line.split()[0] for line in out.splitlines() if " requests in " in line))
    return rps, requests


@dataclass(frozen=True)
class OpenLoop:
    """What an open-loop run measured, in seconds, one value per request."""

    #: From each request's scheduled time to its whole response read.
    latencies: list[float]
    #: From each request's scheduled time to its being written: how late the
    #: generator itself was. A latency tail with no lateness tail is the
    #: app's (or the network's); one that the lateness shares is the
    #: generator's, starved of CPU on the shared cores.
    late: list[float]


async def open_loop(
    port: int,
    requests: list[tuple[bytes, dict[str, str]]],
    rate: int,
    seconds: float,
    connections: int = 32,
) -> OpenLoop:
    """`rate` requests/s for `seconds`, timed from each one's scheduled time."""
    path = "/webhooks/{}".format(requests[0][1]["x-endpoint"])
    raw = []
    for body, headers in requests:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k != "x-endpoint")
        raw.append(
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n{head}"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
    total = int(rate * seconds)
    slots: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
    latencies: list[float] = []
    late: list[float] = []
    failures: list[str] = []

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while True:
                number, scheduled = await slots.get()
                if number < 0:
                    return
                late.append(time.perf_counter() - scheduled)
                writer.write(raw[number % len(raw)])
                status_line = await reader.readline()
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - scheduled)
                if b" 202 " not in status_line:
                    failures.append(status_line.decode().strip())
        finally:
            writer.close()

    workers = [asyncio.create_task(worker()) for _ in range(connections)]
    start = time.perf_counter() + 0.2
    for number in range(total):
        scheduled = start + number / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        slots.put_nowait((number, scheduled))
    for _ in workers:
        slots.put_nowait((-1, 0.0))
    await asyncio.gather(*workers)
    if failures:
        raise RuntimeError(f"{len(failures)} responses were not 202, e.g. {failures[0]}")
    return OpenLoop(latencies, late)


async def compare_enqueue(settings: Settings, count: int = 3200) -> dict[str, tuple[float, float]]:
    """The enqueue step alone, 32 jobs at a time: (CPU µs, wall µs) per job, for
    RQ's `enqueue_event` in a bounded thread pool and for the ingress's writer."""
    envelopes = [
        Envelope(str(uuid.uuid4()), body, headers, datetime.now(UTC), str(uuid.uuid4()))
        for body, headers in signed_requests("whsec_" + "A" * 43 + "=", count)
    ]
    results: dict[str, tuple[float, float]] = {}
    connection = Redis.from_url(settings.redis_url)
    queue = events_queue(connection, settings)
    pool = ThreadPoolExecutor(max_workers=8)
    loop = asyncio.get_running_loop()

    async def threaded(envelope: Envelope) -> None:
        await loop.run_in_executor(pool, enqueue_event, queue, envelope, settings)

    enqueuer = Enqueuer(settings)

    async def batched(envelope: Envelope) -> None:
        await enqueuer.enqueue([envelope])

    for name, enqueue in (("thread pool + enqueue_event", threaded), ("ingress writer", batched)):
        cpu, wall = time.process_time(), time.perf_counter()
        for start in range(0, count, 32):
            await asyncio.gather(*(enqueue(e) for e in envelopes[start : start + 32]))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        results[name] = (cpu / count * 1e6, wall / count * 1e6)
    await enqueuer.close()
    pool.shutdown()
    connection.flushdb()
    connection.close()
    return results


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=8, help="length of each wrk round")
    parser.add_argument("--rounds", type=int, default=3, help="wrk rounds per app")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections")
    parser.add_argument("--rate", type=int, default=1000, help="open-loop requests per second")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--fsync", choices=FSYNC_CHOICES, default="always")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench.ingress: wrk is missing: apt-get install -y wrk", file=sys.stderr)
        return 2

    python = sys.executable
    with (
        private_redis(args.fsync) as (redis_url, redis_pid),
        scratch_endpoint(redis_url) as (settings, endpoint_id, secret),
        tempfile.TemporaryDirectory(prefix="payhook-bench-") as folder,
    ):
        requests = signed_requests(secret, EVENTS)
        script = wrk_script(f"/webhooks/{endpoint_id}", requests, Path(folder))
        env = dict(os.environ) | {
            "DATABASE_URL": settings.database_url,
            "REDIS_URL": redis_url,
            "PAYHOOK_QUEUE": settings.queue,
            "PAYHOOK_LOG_LEVEL": "INFO",
            "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
        }
        bare_port, ingress_port = spare_port(), spare_port()
        uvicorn_args = ["--no-access-log", "--log-level", "warning"]
        bare = [python, "-m", "uvicorn", "bench.ingress:bare_app", "--port", str(bare_port)]
        ingress = [python, "-m", "control.cli", "ingress", "--port", str(ingress_port)]
        with (
            process(bare + uvicorn_args, env, bare_port) as bare_proc,
            process(ingress, env, ingress_port) as ingress_proc,
        ):
            redis = Redis.from_url(redis_url)
            wait_ready(ingress_port)
            # Warm both (imports, connections, caches) before measuring.
            run_wrk(bare_port, script, 2, args.connections)
            run_wrk(ingress_port, script, 2, args.connections)
            bare_rounds, ingress_rounds = [], []
            queued = rewrites = 0
            redis.flushdb()
            for _ in range(args.rounds):
                bare_rounds.append(
                    measure(bare_port, script, args.seconds, args.connections,
                            {"app": bare_proc.pid})
                )  # fmt: skip
                rewrites_before = _aof_rewrites(redis)
                ingress_rounds.append(
                    measure(ingress_port, script, args.seconds, args.connections,
                            {"app": ingress_proc.pid, "redis": redis_pid})
                )  # fmt: skip
                rewrites += _aof_rewrites(redis) - rewrites_before
                # Consumers keep the queue short; a backlog of every round's
                # jobs would have each round run beside ever larger AOF rewrites.
                queued += int(redis.llen(f"rq:queue:{settings.queue}"))
                redis.flushdb()
            for _, headers in requests:
                headers["x-endpoint"] = endpoint_id
            bare_latencies = asyncio.run(
                open_loop(bare_port, requests, args.rate, args.latency_seconds)
            )
            enqueued_before, slow_before = enqueue_waits(ingress_port)
            latencies = asyncio.run(
                open_loop(ingress_port, requests, args.rate, args.latency_seconds)
            )
            enqueued_after, slow_after = enqueue_waits(ingress_port)
            enqueued, slow = enqueued_after - enqueued_before, slow_after - slow_before
            redis.close()
        enqueue_costs = asyncio.run(compare_enqueue(settings))

    bare_rps = [r.rps for r in bare_rounds]
    ingress_rps = [r.rps for r in ingress_rounds]
    bare_median, ingress_median = statistics.median(bare_rps), statistics.median(ingress_rps)
    bare_cpu = statistics.median(r.cpu_us["app"] for r in bare_rounds)
    ingress_cpu = statistics.median(r.cpu_us["app"] for r in ingress_rounds)
    redis_cpu = statistics.median(r.cpu_us["redis"] for r in ingress_rounds)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, ", end="")
    print(f"redis appendfsync={args.fsync}")
    print(f"wrk -t1 -c{args.connections}, {args.rounds} rounds of {args.seconds}s each")
    print(f"  bare Starlette route  {_rates(bare_rps)}  median {bare_median:,.0f} req/s")
    print(f"  ingress               {_rates(ingress_rps)}  median {ingress_median:,.0f} req/s")
    print(f"  ratio ingress/bare    {ingress_median / bare_median:.0%}   (goal >= 50%)")
    print("CPU per request (median; what throughput on a core of its own follows from)")
    print(f"  bare Starlette route  {bare_cpu:,.0f} us")
    print(f"  ingress               {ingress_cpu:,.0f} us   (+ Redis {redis_cpu:,.0f} us)")
    print(f"  ratio bare/ingress    {bare_cpu / ingress_cpu:.0%}   jobs queued: {queued:,}", end="")
    print(f" (Redis emptied after each round; AOF rewrites during the rounds: {rewrites})")
    print(f"open loop at {args.rate} req/s for {args.latency_seconds:.0f}s each", end="")
    print(" (goal: ingress p99 < 10 ms)")
    for name, run in (("bare Starlette route", bare_latencies), ("ingress", latencies)):
        print(f"  {name:20s}  {_latency(run.latencies)}")
        print(f"  {'':20s}  the generator late to send: {_latency(run.late)}")
    print(f"  the ingress's histogram: {slow:,} of {enqueued:,} jobs waited over 10 ms for Redis")
    print("enqueue alone, 32 at a time, per job:")
    for name, (cpu_us, wall_us) in enqueue_costs.items():
        print(f"  {name:28s}  CPU {cpu_us:5.0f} us   wall {wall_us:5.0f} us")
    return 0


def _latency(values: list[float]) -> str:
    p50, p99 = percentile(values, 0.50) * 1000, percentile(values, 0.99) * 1000
    return f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {max(values) * 1000:.2f} ms ({len(values):,})"


def _rates(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:,.0f}" for v in values) + "]"


def _aof_rewrites(redis: Redis) -> int:
    """AOF rewrites Redis has started (0 without an AOF)."""
    return int(redis.info("persistence").get("aof_rewrites", 0))


def enqueue_waits(port: int, over: float = 0.010) -> tuple[int, int]:
    """From the ingress's own histogram: jobs it has enqueued, and how many of
    them waited for Redis longer than `over` seconds (a bucket bound)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    name = "payhook_ingress_enqueue_seconds"
    total = within = None
    for line in text.splitlines():
        if line.startswith(f"{name}_count "):
            total = int(float(line.split()[-1]))
        elif line.startswith(f'{name}_bucket{{le="{over}"}} '):
            within = int(float(line.split()[-1]))
    if total is None or within is None:
        raise RuntimeError(f"the ingress's metrics have no {name} bucket at {over}")
    return total, total - within


def wait_ready(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            if b" 200 " in sock.recv(1024):
                return
        time.sleep(0.1)
    raise RuntimeError("the ingress did not become ready")


if __name__ == "__main__":
    sys.exit(main())
