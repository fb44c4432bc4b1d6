"""Read a request body up to a limit, and not one byte more."""

from __future__ import annotations

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope

from payhook.errors import PayhookError


class BodyTooLarge(PayhookError):
    """The request body is larger than the ingress accepts."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, or `BodyTooLarge` as soon as it is known to exceed `limit` bytes.

    `ClientDisconnect` when the sender goes away mid-body.

    A declared `Content-Length` over the limit is refused before reading
    anything; a body streamed without one is read chunk by chunk and
    abandoned at the first chunk that crosses the limit.
    """
    declared = header(scope, b"content-length")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge()
    return await _read(receive, limit)


async def _read(receive: Receive, limit: int) -> bytes:
    # One growing buffer, not a list of chunks: a body trickled a few bytes at
    # a time would otherwise hold an object per chunk, many times its size.
    buffer = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        if len(buffer) + len(chunk) > limit:
            raise BodyTooLarge()
        if not message.get("more_body", False):
            if not buffer:
                return chunk  # the usual case: the whole body in one message, not copied
            buffer += chunk
            return bytes(buffer)
        buffer += chunk


def header(scope: Scope, name: bytes) -> bytes:
    """The first value of the header `name` (lower-case, as ASGI gives names), or b""."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""
