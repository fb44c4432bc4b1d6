"""The ingress's HTTP connections: uvicorn's httptools protocol with a read deadline.

uvicorn has no timeout for reading a request: `timeout_keep_alive` runs only
between requests, from the end of a response to the next byte. A client that
connects and trickles its head, or its body, keeps the connection and what it
sent for as long as it likes, and httptools buffers a head of any size. Here
every request gets `read_timeout` seconds to arrive whole, head and body,
counted from the connection, or on a kept-alive one from the request's first
byte:

- its head not in by then: 408, and the connection closed (closed without a
  word if the client never sent a byte);
- its body not in by then: the app answers 408 itself, against the same
  deadline, which it finds in the scope (`ingress.body.READ_DEADLINE`); the
  connection closes after whatever response is under way;
- a head over `MAX_HEAD` bytes: 431, and the connection closed.

The one module that touches uvicorn's internals. It relies on
`HttpToolsProtocol`'s parser callbacks (`on_message_begin`,
`on_headers_complete`, `on_message_complete`), its `connection_made`,
`connection_lost`, `data_received` and `shutdown`, and its attributes `loop`,
`transport`, `scope`, `cycle.response_complete` and
`server_state.default_headers`. tests/unit/test_ingress_protocol.py checks
each; pyproject.toml pins uvicorn below its next minor version.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from ingress.body import READ_DEADLINE

#: Bytes a request head (request line and headers) may take.
MAX_HEAD = 64 * 1024

_TIMEOUT = (b"408 Request Timeout", b'{"error": "request_timeout"}')
_HEAD_TOO_LARGE = (b"431 Request Header Fields Too Large", b'{"error": "headers_too_large"}')


def http_protocol(read_timeout: float) -> type[asyncio.Protocol]:
    """The value of uvicorn's `http` option: what it calls to serve each connection."""
    # uvicorn only calls it, with the keyword arguments of a protocol class; a
    # partial, unlike a class made here, also pickles for `--workers`.
    factory = functools.partial(ReadDeadlineProtocol, read_timeout=read_timeout)
    return cast("type[asyncio.Protocol]", factory)


class ReadDeadlineProtocol(HttpToolsProtocol):
    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        read_timeout: float,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.read_timeout = read_timeout
        #: Loop time by which the request being read must be whole; None between requests.
        self._due: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        #: Bytes received for the request being read while its head was not complete.
        self._head_bytes = 0
        self._head_done = False
        #: The scope extension of the request being read, shared with its app.
        self._extension: dict[object, object] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._due = self.loop.time() + self.read_timeout
        self._timer = self.loop.call_at(self._due, self._expire)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._due is None:
            self._due = self.loop.time() + self.read_timeout
        if not self._head_done:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._due is None or self.transport.is_closing():
            return  # the request is whole, or the connection is being closed
        if not self._head_done and self._head_bytes > MAX_HEAD:
            self._refuse(_HEAD_TOO_LARGE)
        elif self._timer is None:
            # Armed only for a request that does not arrive in one piece.
            self._timer = self.loop.call_at(self._due, self._expire)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._due is None:  # a pipelined request, in the same data as the one before
            self._due = self.loop.time() + self.read_timeout
        self._extension = {"at": self._due, "complete": False}
        self.scope["extensions"] = {READ_DEADLINE: self._extension}

    def on_headers_complete(self) -> None:
        self._head_done = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._extension is not None:
            self._extension["complete"] = True
        self._due = self._extension = None
        self._head_bytes = 0
        self._head_done = False
        self._stop_timer()

    def _expire(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A response is under way: to a late body, the app's own 408.
            self.shutdown()  # closes once it is sent
        elif self._head_done or self._head_bytes == 0:
            # Answered already (a 404 before its body), or never asked anything.
            self.transport.close()
        else:
            self._refuse(_TIMEOUT)

    def _refuse(self, answer: tuple[bytes, bytes]) -> None:
        status, body = answer
        lines = [b"HTTP/1.1 " + status]
        lines += [name + b": " + value for name, value in self.server_state.default_headers]
        lines += [b"content-type: application/json", b"content-length: %d" % len(body)]
        lines += [b"connection: close", b"", body]
        self.transport.write(b"\r\n".join(lines))
        self.transport.close()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
