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
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def header(scope: Scope, name: bytes) -> bytes:
    """The first value of the header `name` (lower-case, as ASGI gives names), or b""."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""
