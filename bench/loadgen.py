"""An open-loop HTTP/1.1 load generator light enough not to bound what it measures.

Requests are rendered to bytes before the clock starts; each is written at
its scheduled time (`start + i / rate`) on one of a set of kept-alive
connections, whichever is free, and its response read. A general HTTP
client spends most of a core at a few hundred requests per second, on the
cores the stack being measured runs on; this one spends a few tens of
microseconds per request. It reports how late the sends ran, so a figure
the generator could not offer is never taken for one the stack kept up with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

#: Connections open at most (HTTP/1.1: one request in flight on each).
MAX_CONNECTIONS = 64


@dataclass
class Sent:
    """What an open-loop run did."""

    #: Each accepted request's key, and when its 2xx arrived (wall clock).
    accepted: dict[str, float]
    refused: int
    #: Seconds from the first send to the last, and the latest a send ran behind.
    span: float
    lag: float
    #: When the first request was due (wall clock).
    started: float
    #: CPU seconds the load process spent sending and reading.
    cpu: float = 0.0


def render(url: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    """A POST of `body` to `url` as bytes on the wire."""
    parts = urlsplit(url)
    lines = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"Host: {parts.netloc}",
        f"Content-Length: {len(body)}",
        "Content-Type: application/json",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def post_open_loop(url: str, requests: Sequence[tuple[str, bytes]], rate: float) -> Sent:
    """Send `requests` (key, rendered bytes) at `rate` per second, open loop."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    queue: asyncio.Queue[tuple[str, bytes, float] | None] = asyncio.Queue()
    accepted: dict[str, float] = {}
    refused = 0
    connections = max(2, min(MAX_CONNECTIONS, int(rate // 20)))
    loop = asyncio.get_running_loop()
    lag = 0.0

    async def connection() -> None:
        nonlocal refused, lag
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while (item := await queue.get()) is not None:
                key, request, due = item
                lag = max(lag, loop.time() - due)
                try:
                    writer.write(request)
                    status = await _response(reader)
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    refused += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
                    continue
                if 200 <= status < 300:
                    accepted[key] = time.time()
                else:
                    refused += 1
        finally:
            writer.close()

    workers = [asyncio.create_task(connection()) for _ in range(connections)]
    start, started, cpu = loop.time(), time.time(), time.process_time()
    for i, (key, request) in enumerate(requests):
        due = start + i / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait((key, request, due))
    span = loop.time() - start
    for _ in workers:
        queue.put_nowait(None)
    await asyncio.gather(*workers)
    return Sent(accepted, refused, span, lag, started, time.process_time() - cpu)


async def _response(reader: asyncio.StreamReader) -> int:
    """Read one response; its status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, _, header_block = head.partition(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    length = 0
    for line in header_block.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status
