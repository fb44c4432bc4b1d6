"""Read a request body up to a limit and a deadline, and not one byte more."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope

from payhook.errors import PayhookError

#: Scope extension in which the server (`ingress.protocol`) gives the read
#: deadline of the request: `{"at": <loop time by which the whole request must
#: have arrived>, "complete": <True once it has>}`.
READ_DEADLINE = "payhook.read_deadline"


#: Bytes under which received chunks are gathered into one before being kept.
GATHER = 4096


class BodyTooLarge(PayhookError):
    """The request body is larger than the ingress accepts."""


class ReadTimeout(PayhookError):
    """The request did not arrive whole within the read deadline."""


async def read_body(scope: Scope, receive: Receive, limit: int, timeout: float) -> bytes:
    """The whole body, or `BodyTooLarge` as soon as it is known to exceed `limit` bytes.

    `ClientDisconnect` when the sender goes away mid-body; `ReadTimeout` when
    the body is not in by the server's deadline for the whole request, or,
    under a server that gives none, `timeout` seconds from now.

    A declared `Content-Length` over the limit is refused before reading
    anything; a body streamed without one is read chunk by chunk and
    abandoned at the first chunk that crosses the limit.
    """
    declared = header(scope, b"content-length")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge()
    given = scope.get("extensions", {}).get(READ_DEADLINE)
    if given is not None and given.get("complete"):
        # The server already holds all of it: nothing to wait for, no timer to arm.
        return await _read(receive, limit)
    deadline = given["at"] if given is not None else asyncio.get_running_loop().time() + timeout
    try:
        async with asyncio.timeout_at(deadline):
            return await _read(receive, limit)
    except TimeoutError:
        raise ReadTimeout() from None


async def _read(receive: Receive, limit: int) -> bytes:
    # Chunks are kept as they come, never copied into a growing buffer (whose
    # reallocations leave the heap in pieces); chunks under GATHER bytes are
    # gathered first, so that a body trickled a few bytes at a time does not
    # hold an object per chunk, many times its size.
    chunks: list[bytes] = []
    small = bytearray()
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        if not message.get("more_body", False):
            if size == len(chunk):
                return chunk  # the usual case: the whole body in one message, not copied
            chunks += (bytes(small), chunk)
            return b"".join(chunks)
        if len(chunk) < GATHER:
            small += chunk
            if len(small) < GATHER:
                continue
            chunk = bytes(small)
            small.clear()
        elif small:
            chunks.append(bytes(small))
            small.clear()
        chunks.append(chunk)


def header(scope: Scope, name: bytes) -> bytes:
    """The first value of the header `name` (lower-case, as ASGI gives names), or b""."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""
