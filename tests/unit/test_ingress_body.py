"""The body is read up to the limit and the deadline, and not one chunk further."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from typing import Any

import pytest
from starlette.types import Message, Scope

from ingress.body import READ_DEADLINE, BodyTooLarge, ReadTimeout, read_body

CHUNK = 64 * 1024
#: Seconds the tests' reads may wait: never reached by a test that does not time out.
PATIENT = 60.0


class Sender:
    """An ASGI receive callable streaming `chunks` chunks (forever when None)."""

    def __init__(self, chunks: int | None, size: int = CHUNK, stall_after: int | None = None):
        self.chunks = chunks
        self.size = size
        self.stall_after = stall_after
        self.calls = 0

    async def __call__(self) -> Message:
        self.calls += 1
        if self.stall_after is not None and self.calls > self.stall_after:
            await asyncio.sleep(3600)  # a sender that went quiet
        more = self.chunks is None or self.calls < self.chunks
        return {"type": "http.request", "body": b"x" * self.size, "more_body": more}


def scope(headers: dict[str, str] | None = None, extensions: dict[str, Any] | None = None) -> Scope:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "method": "POST", "headers": raw, "extensions": extensions or {}}


def test_endless_stream_is_abandoned_at_the_first_chunk_over_the_limit() -> None:
    receive = Sender(chunks=None)
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(scope(), receive, limit=4 * CHUNK, timeout=PATIENT))
    assert receive.calls == 5


def test_declared_length_over_the_limit_reads_nothing() -> None:
    receive = Sender(chunks=None)
    with pytest.raises(BodyTooLarge):
        asyncio.run(
            read_body(scope({"content-length": str(10**9)}), receive, CHUNK, timeout=PATIENT)
        )
    assert receive.calls == 0


def test_body_of_exactly_the_limit_is_read_whole() -> None:
    receive = Sender(chunks=3)
    body = asyncio.run(read_body(scope(), receive, limit=3 * CHUNK, timeout=PATIENT))
    assert body == b"x" * 3 * CHUNK


def test_a_body_trickled_in_tiny_chunks_holds_little_more_than_its_size() -> None:
    """A slow sender's chunks are a few bytes each: not an object per chunk."""
    size = 256 * 1024
    receive = Sender(chunks=size // 4, size=4)
    tracemalloc.start()
    try:
        body = asyncio.run(read_body(scope(), receive, limit=size, timeout=PATIENT))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(body) == size
    assert peak < 3 * size, f"{peak} bytes at most to read {size}"


def test_chunks_small_and_large_are_joined_in_order() -> None:
    sizes = [1, 5000, 3, 3, 4090, 2, 4096, 7, 1, 9000, 4095, 1, 1]
    chunks = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    messages = iter(enumerate(chunks, 1))

    async def receive() -> Message:
        number, chunk = next(messages)
        return {"type": "http.request", "body": chunk, "more_body": number < len(chunks)}

    body = asyncio.run(read_body(scope(), receive, limit=sum(sizes), timeout=PATIENT))
    assert body == b"".join(chunks)


def test_a_body_not_in_by_the_timeout_is_abandoned() -> None:
    receive = Sender(chunks=10, stall_after=2)
    started = time.monotonic()
    with pytest.raises(ReadTimeout):
        asyncio.run(read_body(scope(), receive, limit=10 * CHUNK, timeout=0.05))
    assert time.monotonic() - started < 5
    assert receive.calls == 3


def test_the_servers_deadline_for_the_whole_request_comes_first() -> None:
    """The head took part of the time: the body gets what is left, not a fresh timeout."""

    async def read() -> bytes:
        deadline = asyncio.get_running_loop().time() + 0.05
        given = scope(extensions={READ_DEADLINE: {"at": deadline, "complete": False}})
        return await read_body(given, Sender(chunks=10, stall_after=1), CHUNK * 10, PATIENT)

    started = time.monotonic()
    with pytest.raises(ReadTimeout):
        asyncio.run(read())
    assert time.monotonic() - started < 5


def test_a_body_the_server_holds_whole_is_read_without_a_deadline() -> None:
    """Complete before its deadline: read even if the loop gets to it late."""

    async def read() -> bytes:
        past = asyncio.get_running_loop().time() - 1
        given = scope(extensions={READ_DEADLINE: {"at": past, "complete": True}})
        return await read_body(given, Sender(chunks=2), 2 * CHUNK, PATIENT)

    assert asyncio.run(read()) == b"x" * 2 * CHUNK
