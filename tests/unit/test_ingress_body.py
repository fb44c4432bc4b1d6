"""The body is read up to the limit and not one chunk further."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest
from starlette.types import Message, Scope

from ingress.body import BodyTooLarge, read_body

CHUNK = 64 * 1024


class Sender:
    """An ASGI receive callable streaming `chunks` chunks (forever when None)."""

    def __init__(self, chunks: int | None, size: int = CHUNK) -> None:
        self.chunks = chunks
        self.size = size
        self.calls = 0

    async def __call__(self) -> Message:
        self.calls += 1
        more = self.chunks is None or self.calls < self.chunks
        return {"type": "http.request", "body": b"x" * self.size, "more_body": more}


def scope(headers: dict[str, str] | None = None) -> Scope:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "method": "POST", "headers": raw}


def test_endless_stream_is_abandoned_at_the_first_chunk_over_the_limit() -> None:
    receive = Sender(chunks=None)
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(scope(), receive, limit=4 * CHUNK))
    assert receive.calls == 5


def test_declared_length_over_the_limit_reads_nothing() -> None:
    receive = Sender(chunks=None)
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(scope({"content-length": str(10**9)}), receive, limit=CHUNK))
    assert receive.calls == 0


def test_body_of_exactly_the_limit_is_read_whole() -> None:
    receive = Sender(chunks=3)
    body = asyncio.run(read_body(scope(), receive, limit=3 * CHUNK))
    assert body == b"x" * 3 * CHUNK


def test_a_body_trickled_in_tiny_chunks_holds_little_more_than_its_size() -> None:
    """A slow sender's chunks are a few bytes each: not an object per chunk."""
    size = 256 * 1024
    receive = Sender(chunks=size // 4, size=4)
    tracemalloc.start()
    try:
        body = asyncio.run(read_body(scope(), receive, limit=size))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(body) == size
    assert peak < 3 * size, f"{peak} bytes at most to read {size}"
