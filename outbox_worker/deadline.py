"""A wall-clock deadline for one delivery's HTTP exchange.

httpx's timeouts bound each step (connecting, each read, each write), not
the whole request: a receiver that trickles its response a byte at a time
could hold a delivery past its lease, and another worker would then send the
row again meanwhile. Every socket operation of the client `build_transport`
makes is given at most the time left before the deadline of the delivery
running on that thread (`within`), and fails with a timeout once it has
passed. Threads with no deadline keep httpx's timeouts as they are.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import httpcore
import httpx

from outbox_worker.egress import PinnedBackend
from payhook.compat import replace_connection_pool
from payhook.destinations import DestinationPolicy

_local = threading.local()


@contextmanager
def within(deadline: float) -> Iterator[None]:
    """HTTP on this thread must be done by `deadline` (`time.monotonic()`)."""
    _local.deadline = deadline
    try:
        yield
    finally:
        _local.deadline = None


def current() -> float | None:
    """This thread's deadline, if a delivery on it has one."""
    return getattr(_local, "deadline", None)


def _clip(timeout: float | None, error: type[Exception]) -> float | None:
    deadline = current()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the delivery's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _clip(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _clip(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        tls = self._stream.start_tls(
            ssl_context, server_hostname, _clip(timeout, httpcore.ConnectTimeout)
        )
        return _Stream(tls)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._backend.connect_tcp(
            host, port, _clip(timeout, httpcore.ConnectTimeout), local_address, socket_options
        )
        return _Stream(stream)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._backend.connect_unix_socket(
            path, _clip(timeout, httpcore.ConnectTimeout), socket_options
        )
        return _Stream(stream)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def build_transport(
    limits: httpx.Limits, destinations: DestinationPolicy | None = None
) -> httpx.HTTPTransport:
    """httpx's own transport, its socket operations bounded by the thread's deadline,
    and, given `destinations`, its connections made only to addresses they
    allow (`outbox_worker.egress`).

    httpx does not take a network backend; its connection pool does, so the
    transport's pool is replaced by an equivalent one that has it
    (`payhook.compat.replace_connection_pool`). A test sends to a receiver that trickles its
    answer and checks that the delivery gives up at its deadline.
    """
    transport = httpx.HTTPTransport(limits=limits)
    backend: httpcore.NetworkBackend = _Backend()
    if destinations is not None:
        # Outside the deadline's backend: each address tried gets the time left.
        backend = PinnedBackend(destinations, backend)
    pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=backend,
    )
    replace_connection_pool(transport, pool)
    return transport
