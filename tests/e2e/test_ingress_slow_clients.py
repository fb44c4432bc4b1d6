"""The ingress as a real uvicorn process under slow and hostile clients, over real sockets.

Slow clients send a request a byte at a time; the ingress must cut them once
PAYHOOK_READ_TIMEOUT has passed, answer the others meanwhile, and refuse
connections beyond PAYHOOK_INGRESS_LIMIT_CONCURRENCY.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from payhook.settings import Settings
from tests.e2e.test_ingress_process import Ingress, env_for
from tests.factories import Factory, Shop, StandardEvent
from tests.processes import stop

pytestmark = pytest.mark.slow

#: Seconds between two bytes of a slow client.
PACE = 0.1
#: Seconds a cut may come after the deadline on a busy machine (the suite runs
#: four workers on two cores): cut by the deadline, not held until the client
#: gives up, which no client here does before its socket's 10 s timeout.
LATE = 6.0


class SlowClients:
    """`count` connections that each send `at_once`, then `trickled` a byte every PACE
    seconds, on a thread of their own; when the server cut each, and what it answered."""

    def __init__(self, port: int, count: int, at_once: bytes = b"", trickled: bytes = b""):
        self.trickled = trickled
        self.socks: list[socket.socket] = []
        self.opened: list[float] = []
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(at_once)
            sock.setblocking(False)
            self.socks.append(sock)
            self.opened.append(time.monotonic())
        self.answers = [b""] * count
        #: Seconds from connecting to the server closing, per connection; None while open.
        self.cut_after: list[float | None] = [None] * count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def cut(self) -> int:
        return sum(after is not None for after in self.cut_after)

    def wait(self, timeout: float) -> None:
        self._thread.join(timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in self.socks:
            sock.close()

    def _run(self) -> None:
        sent = 0
        while not self._stop.is_set() and self.cut() < len(self.socks):
            for i, sock in enumerate(self.socks):
                if self.cut_after[i] is None and self._closed(i, sock):
                    self.cut_after[i] = time.monotonic() - self.opened[i]
                elif self.cut_after[i] is None and sent < len(self.trickled):
                    try:
                        sock.send(self.trickled[sent : sent + 1])
                    except OSError:
                        self.cut_after[i] = time.monotonic() - self.opened[i]
            sent += 1
            self._stop.wait(PACE)

    def _closed(self, i: int, sock: socket.socket) -> bool:
        try:
            while chunk := sock.recv(4096):
                self.answers[i] += chunk
        except BlockingIOError:
            return False
        except OSError:
            pass  # reset
        return True


@contextmanager
def slow_clients(port: int, count: int, at_once: bytes, trickled: bytes) -> Iterator[SlowClients]:
    clients = SlowClients(port, count, at_once, trickled)
    try:
        yield clients
    finally:
        clients.close()


@contextmanager
def ingress_with(settings: Settings, tmp_path: Path, **env: str) -> Iterator[Ingress]:
    ingress = Ingress(env_for(settings, str(settings.redis_url)) | env, tmp_path / "ingress.log")
    try:
        yield ingress
    finally:
        stop(ingress.proc)


def head(shop: Shop, length: int) -> bytes:
    """A webhook request's head, whole, for a body of `length` bytes."""
    return (
        f"POST /webhooks/{shop.endpoint_id} HTTP/1.1\r\nhost: ingress\r\n"
        f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    ).encode()


def endless_head(shop: Shop) -> bytes:
    """A head longer than a slow client can send before any deadline of these tests."""
    return head(shop, 10).removesuffix(b"\r\n") + b"x-padding: " + b"p" * 500


def test_a_head_sent_slower_than_the_read_timeout_is_cut_with_a_408(
    settings: Settings, factory: Factory, tmp_path: Path
) -> None:
    shop = factory.shop()
    with (
        ingress_with(settings, tmp_path, PAYHOOK_READ_TIMEOUT="1s") as ingress,
        slow_clients(ingress.port, 3, b"", endless_head(shop)) as trickling,
        slow_clients(ingress.port, 1, b"", b"") as silent,
    ):
        trickling.wait(1 + LATE)
        silent.wait(1)
        for after, answer in zip(trickling.cut_after, trickling.answers, strict=True):
            assert after is not None and 1 <= after < 1 + LATE, after
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert answer.endswith(b'\r\n\r\n{"error": "request_timeout"}')
        # A connection that never said a word is closed without one.
        [after] = silent.cut_after
        assert after is not None and 1 <= after < 1 + LATE, after
        assert silent.answers == [b""]


def test_a_body_sent_slower_than_the_read_timeout_is_408_and_closed(
    settings: Settings, factory: Factory, tmp_path: Path
) -> None:
    shop = factory.shop()
    body = StandardEvent().body()
    with (
        ingress_with(settings, tmp_path, PAYHOOK_READ_TIMEOUT="1s") as ingress,
        slow_clients(ingress.port, 3, head(shop, len(body)), body) as clients,
    ):
        clients.wait(1 + LATE)
        for after, answer in zip(clients.cut_after, clients.answers, strict=True):
            assert after is not None and 1 <= after < 1 + LATE, after
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert b"\r\nconnection: close\r\n" in answer
    received = [line for line in ingress.lines() if line.get("event") == "webhook_received"]
    assert [(line["status"], line["reason"]) for line in received] == [(408, "read_timeout")] * 3


def test_a_normal_webhook_is_accepted_while_slow_clients_hold_connections(
    settings: Settings, factory: Factory, tmp_path: Path
) -> None:
    """Then every slow client is cut once the deadline has passed."""
    shop = factory.shop()
    event = StandardEvent()
    body = event.body()
    with (
        ingress_with(settings, tmp_path, PAYHOOK_READ_TIMEOUT="5s") as ingress,
        slow_clients(ingress.port, 100, b"", endless_head(shop)) as heads,
        slow_clients(ingress.port, 100, head(shop, len(body)), body) as bodies,
    ):
        started = time.perf_counter()
        accepted = httpx.post(
            ingress.url(shop.endpoint_id),
            content=body,
            headers=event.headers(shop.secret, body),
            timeout=10,
        )
        print(f"202 in {(time.perf_counter() - started) * 1000:.1f} ms beside 200 slow clients")
        assert accepted.status_code == 202, accepted.text
        assert heads.cut() == bodies.cut() == 0, "the slow clients were cut before the test"

        heads.wait(5 + LATE)
        bodies.wait(5 + LATE)
        assert heads.cut() == bodies.cut() == 100
        assert {answer[:13] for answer in heads.answers + bodies.answers} == {b"HTTP/1.1 408 "}


def test_requests_beyond_the_connection_limit_are_503(
    settings: Settings, factory: Factory, tmp_path: Path
) -> None:
    shop = factory.shop()
    event = StandardEvent()
    body = event.body()

    def post() -> httpx.Response:
        headers = event.headers(shop.secret, body)
        return httpx.post(ingress.url(shop.endpoint_id), content=body, headers=headers, timeout=10)

    limit = {"PAYHOOK_INGRESS_LIMIT_CONCURRENCY": "10", "PAYHOOK_READ_TIMEOUT": "30s"}
    with ingress_with(settings, tmp_path, **limit) as ingress:
        with slow_clients(ingress.port, 10, endless_head(shop)[:40], b""):
            refused = post()
            assert refused.status_code == 503
            assert refused.headers["connection"] == "close"
        # The held connections gone, the same request is accepted.
        wait = time.monotonic() + 10
        while (accepted := post()).status_code == 503 and time.monotonic() < wait:
            time.sleep(0.1)
        assert accepted.status_code == 202


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(
    settings: Settings, factory: Factory, tmp_path: Path
) -> None:
    with (
        ingress_with(settings, tmp_path, PAYHOOK_INGRESS_KEEP_ALIVE="1s") as ingress,
        socket.create_connection(("127.0.0.1", ingress.port), timeout=10) as sock,
    ):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: ingress\r\n\r\n")
        # The whole response first: its head and body may come in two segments.
        answer = b""
        while not answer.endswith(b'{"status": "ok"}'):
            chunk = sock.recv(4096)
            assert chunk, f"closed before the whole response: {answer!r}"
            answer += chunk
        answered = time.monotonic()
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert sock.recv(4096) == b""  # waits until the server closes
        assert 0.9 <= time.monotonic() - answered < 1 + LATE


def test_a_head_over_the_limit_is_431_without_being_read_further(
    settings: Settings, factory: Factory, tmp_path: Path
) -> None:
    shop = factory.shop()
    with (
        ingress_with(settings, tmp_path) as ingress,
        socket.create_connection(("127.0.0.1", ingress.port), timeout=10) as sock,
    ):
        sock.sendall(endless_head(shop) + b"p" * 100 * 1024)
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass  # closed with the rest unread: the answer came first
        assert answer.startswith(b"HTTP/1.1 431 "), answer
        _, _, content = answer.partition(b"\r\n\r\n")
        assert json.loads(content) == {"error": "headers_too_large"}
