"""Deliveries go only where `payhook.destinations` allows, checked when connecting.

A check of the URL before sending is not enough: the name is resolved again
when the connection is made, and a name whose answers change (DNS rebinding)
can pass the check with a public address and connect to an internal one. So
the check sits where the connection is made. httpcore hands its network
backend the host and port of each new connection; `PinnedBackend` resolves
the host itself, refuses it if any address is refused, and connects to the
addresses it checked, never to the name, so no second answer is asked for.
TLS is still started with the URL's host name (httpcore passes it to
`start_tls`), so the certificate and SNI are checked against the name, and
the `Host` header comes from the URL as ever. A pooled connection is only
reused for the same scheme, host and port, to the address checked when it
was made.

What a backend cannot see, the URL's scheme and credentials, is checked by
a request hook before anything is sent (`check_request`).

Through a proxy named by the environment (`HTTPS_PROXY` and the like) the
connection is the proxy's, and so is the resolution: the hook then also
resolves the host and checks its addresses, but cannot pin them. An egress
proxy should refuse internal addresses itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import httpcore
import httpx

from payhook.destinations import DestinationPolicy, DestinationRefused, Resolve


class PinnedBackend(httpcore.NetworkBackend):
    """Connects only to addresses `destinations` allows, resolved once per connection."""

    def __init__(
        self,
        destinations: DestinationPolicy,
        backend: httpcore.NetworkBackend,
        resolve: Resolve | None = None,
    ) -> None:
        self.destinations = destinations
        self._backend = backend
        self._resolve = resolve

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            addresses = self.destinations.check_host(host, port, self._resolve)
        except OSError as exc:
            # A name that does not resolve: a connection error, retried.
            raise httpcore.ConnectError(f"cannot resolve the host: {exc}") from exc
        failure: Exception | None = None
        # Each address in turn, as `socket.create_connection` would try them.
        for address in addresses:
            try:
                return self._backend.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        assert failure is not None
        raise failure

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        raise DestinationRefused("a unix socket is never a fulfilment destination")

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def check_request(
    destinations: DestinationPolicy, *, resolve: bool = False
) -> Callable[[httpx.Request], None]:
    """An httpx request hook refusing a URL by its scheme, credentials or an
    address written in it; with `resolve`, by the addresses its host resolves
    to as well (for a proxied client, whose connections are not pinned)."""

    def check(request: httpx.Request) -> None:
        host, port = destinations.check_url(str(request.url))
        if resolve:
            try:
                destinations.check_host(host, port)
            except OSError as exc:
                raise httpx.ConnectError(f"cannot resolve the host: {exc}") from exc

    return check
