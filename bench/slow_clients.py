"""The ingress under slow clients: its memory, and a normal sender's latency meanwhile.

    python -m bench.slow_clients [--heads 1000] [--bodies 500] [--read-timeout 10s]
                                 [--limit N] [--hold 20]

One `payhook ingress` process (a private Redis, a scratch database with one
endpoint). After a warm-up, `--heads` connections send a request head a byte
a second and `--bodies` connections send a whole head declaring a body of
256 KiB (the default PAYHOOK_MAX_BODY), most of it at once, then the rest a
byte a second.
Meanwhile a normal sender posts a signed webhook every 50 ms, each on a new
connection. Slow clients still open after `--hold` seconds give up.

Reported: the ingress's resident memory before, at its peak and once the slow
clients are gone; how the slow clients ended (408, 503, closed) and after how
long; the normal sender's statuses and the latency of its 202s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field

from bench.ingress import scratch_endpoint, signed_requests, wait_ready
from bench.services import private_redis, spare_port, wait_for_port
from tests.factories import TEST_SECRETS_KEY

#: Body size slow senders declare, in bytes: the default PAYHOOK_MAX_BODY.
DECLARED = 256 * 1024
#: Bytes of it slow senders send at once before trickling the rest.
PREFIX = 200 * 1024
#: Seconds between two normal requests.
NORMAL_EVERY = 0.05


@dataclass
class Outcomes:
    #: How each slow client ended: its status line's code, "closed" or "held".
    ends: Counter[str] = field(default_factory=Counter)
    cut_after: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def slow_client(
    port: int, at_once: bytes, trickled: bytes, hold: float, out: Outcomes
) -> None:
    loop = asyncio.get_running_loop()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        out.ends["refused"] += 1
        return
    opened = loop.time()
    writer.write(at_once)
    answer = asyncio.ensure_future(reader.read())
    for byte in trickled:
        await asyncio.wait({answer}, timeout=1.0)
        if answer.done() or loop.time() - opened > hold:
            break
        writer.write(bytes([byte]))
    await asyncio.wait({answer}, timeout=max(0.0, hold - (loop.time() - opened)))
    if not answer.done():
        out.ends["held"] += 1
        answer.cancel()
    else:
        out.cut_after.append(loop.time() - opened)
        try:
            data = answer.result()
        except ConnectionResetError:
            # Closed with bytes of ours unread: the kernel resets, and may drop
            # an answer the server wrote before.
            out.ends["reset"] += 1
        else:
            out.ends[data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else "closed"] += 1
    writer.close()


async def normal_sender(port: int, requests: list[bytes], until: float, out: Outcomes) -> None:
    loop = asyncio.get_running_loop()
    for raw in requests:
        if loop.time() > until:
            return
        started = loop.time()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            answer = await asyncio.wait_for(reader.read(), 30)
            writer.close()
        except (OSError, TimeoutError):
            out.statuses["error"] += 1
            continue
        status = answer[9:12].decode()
        out.statuses[status] += 1
        if status == "202":
            out.latencies.append(loop.time() - started)
        await asyncio.sleep(max(0.0, NORMAL_EVERY - (loop.time() - started)))


def raw_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: ingress\r\nconnection: close\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body


async def storm(
    args: argparse.Namespace, port: int, pid: int, path: str, normal: list[bytes]
) -> None:
    loop = asyncio.get_running_loop()
    heads, bodies, normals = Outcomes(), Outcomes(), Outcomes()
    for raw in normal[:100]:  # warm-up: imports, connections, caches
        await normal_sender(port, [raw], loop.time() + 60, Outcomes())
    before = peak = rss_mb(pid)
    head = f"POST {path} HTTP/1.1\r\nhost: ingress\r\ncontent-type: application/json\r\n"
    endless = head.encode() + b"x-padding: " + b"p" * 1000
    body_head = (head + f"content-length: {DECLARED}\r\n\r\n").encode()
    started = loop.time()
    clients = [slow_client(port, b"", endless, args.hold, heads) for _ in range(args.heads)]
    clients += [
        slow_client(port, body_head + b"x" * PREFIX, b"x" * 1000, args.hold, bodies)
        for _ in range(args.bodies)
    ]
    tasks = [asyncio.ensure_future(client) for client in clients]
    sender = asyncio.ensure_future(
        normal_sender(port, normal[100:], started + args.hold + 2, normals)
    )
    while not all(task.done() for task in tasks):
        peak = max(peak, rss_mb(pid))
        await asyncio.sleep(0.25)
    gone = loop.time() - started
    await sender
    await asyncio.sleep(3)  # let the server finish closing
    after = rss_mb(pid)
    print(f"slow clients: {args.heads} heads, {args.bodies} bodies; gone after {gone:.1f} s")
    for name, slow in (("heads", heads), ("bodies", bodies)):
        print(f"  {name} ended:", dict(sorted(slow.ends.items())), end="")
        if slow.cut_after:
            cuts = sorted(slow.cut_after)
            print(f"; cut after median {statistics.median(cuts):.2f} s, max {cuts[-1]:.2f} s")
        else:
            print()
    print(f"ingress RSS: before {before:.0f} MB, peak {peak:.0f} MB, after {after:.0f} MB")
    print("normal sender:", dict(sorted(normals.statuses.items())))
    if normals.latencies:
        ms = sorted(1000 * s for s in normals.latencies)
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        print(
            f"  202 latency: median {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, "
            f"max {ms[-1]:.1f} ms over {len(ms)}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=1000, help="slow-head connections")
    parser.add_argument("--bodies", type=int, default=500, help="slow-body connections")
    parser.add_argument("--read-timeout", default="10s", help="PAYHOOK_READ_TIMEOUT")
    parser.add_argument("--limit", type=int, help="PAYHOOK_INGRESS_LIMIT_CONCURRENCY")
    parser.add_argument("--hold", type=float, default=20.0, help="seconds a slow client tries")
    args = parser.parse_args(argv)
    with (
        private_redis("everysec") as (redis_url, _),
        scratch_endpoint(redis_url, "payhook_bench_slow_clients") as (settings, endpoint, secret),
    ):
        path = f"/webhooks/{endpoint}"
        normal = [
            raw_request(path, body, headers) for body, headers in signed_requests(secret, 800)
        ]
        env = dict(os.environ) | {
            "DATABASE_URL": settings.database_url,
            "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
            "REDIS_URL": redis_url,
            "PAYHOOK_QUEUE": settings.queue,
            "PAYHOOK_LOG_LEVEL": "WARNING",
            "PAYHOOK_READ_TIMEOUT": args.read_timeout,
        }
        if args.limit is not None:
            env["PAYHOOK_INGRESS_LIMIT_CONCURRENCY"] = str(args.limit)
        port = spare_port()
        command = [sys.executable, "-m", "control.cli", "ingress", "--port", str(port)]
        # Output to a file: uvicorn logs each request refused over the limit,
        # and a pipe nobody reads would soon stop the server.
        with tempfile.TemporaryFile() as log:
            ingress = subprocess.Popen(command, env=env, stdout=log, stderr=log)
            try:
                wait_for_port(port)
                wait_ready(port)
                asyncio.run(storm(args, port, ingress.pid, path, normal))
            finally:
                ingress.terminate()
                ingress.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
