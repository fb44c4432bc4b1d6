"""The worker's client goes only where the policy allows (`outbox_worker.egress`).

Every socket here is on 127.0.0.1; names resolve through a stand-in resolver
or to `localhost`.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx
import pytest

from outbox_worker import deadline
from outbox_worker.config import OutboxSettings
from outbox_worker.egress import PinnedBackend
from outbox_worker.handlers import post_delivery
from outbox_worker.main import build_client
from payhook import destinations
from payhook.destinations import DestinationPolicy, DestinationRefused
from tests.factories import LOCAL_RECEIVERS
from tests.unit.test_outbox_handlers import make_claim

#: http allowed, no network allowed.
NO_LOCAL_RECEIVERS = DestinationPolicy(allow_insecure=True)


class Listener:
    """A socket on 127.0.0.1 that tells whether anything connected to it."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.3)
        self.port = int(self.server.getsockname()[1])

    def connected(self) -> bool:
        try:
            connection, _ = self.server.accept()
        except TimeoutError:
            return False
        connection.close()
        return True


@pytest.fixture
def listener() -> Iterator[Listener]:
    found = Listener()
    yield found
    found.server.close()


def test_a_refused_host_is_never_connected_to(listener: Listener) -> None:
    transport = deadline.build_transport(httpx.Limits(), NO_LOCAL_RECEIVERS)
    with httpx.Client(transport=transport) as client:
        outcome = post_delivery(client, make_claim(f"http://localhost:{listener.port}/fulfil"))
    assert outcome.kind == "dead" and outcome.error is not None
    assert outcome.error.startswith("destination refused: ") and "loopback" in outcome.error
    assert not listener.connected()


def test_a_name_that_does_not_resolve_is_a_connection_error_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unknown(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(destinations, "resolve_host", unknown)
    transport = deadline.build_transport(httpx.Limits(), NO_LOCAL_RECEIVERS)
    with httpx.Client(transport=transport) as client:
        outcome = post_delivery(client, make_claim("http://shop.example/fulfil"))
    assert outcome.kind == "retry" and outcome.error is not None
    assert outcome.error.startswith("connection error: ConnectError: cannot resolve the host")


def test_each_checked_address_is_tried_in_turn(listener: Listener) -> None:
    """As `socket.create_connection` does: a second address is tried when the
    first refuses the connection, and both were checked first."""
    tried: list[str] = []

    class Recording(httpcore.SyncBackend):
        def connect_tcp(
            self,
            host: str,
            port: int,
            timeout: float | None = None,
            local_address: str | None = None,
            socket_options: Iterable[Any] | None = None,
        ) -> httpcore.NetworkStream:
            tried.append(host)
            if host == "127.0.0.2":
                raise httpcore.ConnectError("refused")
            return super().connect_tcp(host, port, timeout, local_address, socket_options)

    backend = PinnedBackend(LOCAL_RECEIVERS, Recording(), lambda h, p: ["127.0.0.2", "127.0.0.1"])
    backend.connect_tcp("shop.example", listener.port).close()
    assert tried == ["127.0.0.2", "127.0.0.1"] and listener.connected()


def test_a_unix_socket_is_never_a_destination() -> None:
    backend = PinnedBackend(LOCAL_RECEIVERS, httpcore.SyncBackend())
    with pytest.raises(DestinationRefused):
        backend.connect_unix_socket("/var/run/docker.sock")


def test_the_worker_client_checks_scheme_and_credentials_before_sending(
    listener: Listener,
) -> None:
    config = OutboxSettings(timeout=0.5, destinations=LOCAL_RECEIVERS)
    with build_client(config) as client:
        outcome = post_delivery(
            client, make_claim(f"http://user:s3cr3t@127.0.0.1:{listener.port}/fulfil")
        )
    assert outcome.kind == "dead" and outcome.error is not None
    assert "credentials" in outcome.error and "s3cr3t" not in outcome.error
    assert not listener.connected()


def test_through_a_proxy_the_host_is_resolved_and_checked_before_sending(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy connects and resolves, so the check cannot be pinned; it is
    still made, here, before the proxy is asked anything."""
    proxy = f"http://127.0.0.1:{listener.port}"
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy)
    monkeypatch.setattr(urllib.request, "getproxies", lambda: {"http": proxy})
    config = OutboxSettings(timeout=0.5, destinations=NO_LOCAL_RECEIVERS)
    with build_client(config) as client:
        outcome = post_delivery(client, make_claim("http://localhost:8080/fulfil"))
    assert outcome.kind == "dead" and outcome.error is not None
    assert "loopback" in outcome.error
    assert not listener.connected()
