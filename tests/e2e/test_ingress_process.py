"""The ingress as a real uvicorn process: storms, Redis and PostgreSQL outages, limits.

Each test runs `payhook ingress` against a Redis of its own (a redis-server on
a spare port, stopped and restarted at will) and reaches PostgreSQL through a
TCP proxy the test can cut, so the shared servers are never stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from redis import Redis
from redis.exceptions import RedisError

from payhook.settings import Settings
from tests.conftest import test_settings
from tests.factories import Factory, StandardEvent
from tests.processes import process_env, start, stop, wait_until

pytestmark = pytest.mark.slow


def spare_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server of the test's own, with an append-only file that survives restarts."""

    def __init__(self, folder: Path) -> None:
        self.port = spare_port()
        self.folder = folder
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes", "--dir", str(self.folder), "--daemonize", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, 10, f"redis-server on {self.port}")

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def _answers(self) -> bool:
        try:
            return bool(Redis(port=self.port, socket_timeout=0.5).ping())
        except (OSError, RedisError):
            return False


class Proxy:
    """A TCP proxy to PostgreSQL; `cut()` closes it and every connection through it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = spare_port()
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def open(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        assert self._listener is not None
        # shutdown() wakes the thread blocked in accept(); close() alone would not.
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Ingress:
    """`payhook ingress` on a spare port."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = spare_port()
        self.log = log
        self.proc = start(["ingress", "--port", str(self.port)], env, log)
        wait_until(self._ready, 30, f"ingress on {self.port} to be ready")

    def url(self, endpoint_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/webhooks/{endpoint_id}"

    def post(self, endpoint_id: str, event: StandardEvent, secret: str) -> httpx.Response:
        body = event.body()
        headers = event.headers(secret, body)
        return httpx.post(self.url(endpoint_id), content=body, headers=headers, timeout=10)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=10)

    def lines(self) -> list[dict[str, object]]:
        """The JSON log lines the process wrote."""
        lines = []
        for raw in self.log.read_text().splitlines():
            if raw.startswith("{"):
                lines.append(json.loads(raw))
        return lines

    def _ready(self) -> bool:
        try:
            return self.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture
def proxy(settings: Settings) -> Proxy:
    """A proxy to the test database's server."""
    url = urlsplit(str(settings.database_url))
    proxy = Proxy((url.hostname or "127.0.0.1", url.port or 5432))
    proxy.open()
    return proxy


def env_for(settings: Settings, redis_url: str, database_url: str | None = None) -> dict[str, str]:
    own = test_settings(settings.database_url.rsplit("/", 1)[1], REDIS_URL=redis_url)
    return process_env(
        own,
        DATABASE_URL=database_url or str(own.database_url),
        PAYHOOK_ENDPOINT_REFRESH="0.3s",
        PAYHOOK_ENQUEUE_TIMEOUT="1s",
    )


def drain(env: dict[str, str], log: Path) -> None:
    """`payhook consumer --burst`: apply everything queued, then exit."""
    proc = start(["consumer", "--burst"], env, log)
    assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]


def via_proxy(settings: Settings, proxy: Proxy) -> str:
    url = urlsplit(str(settings.database_url))
    netloc = url.netloc.rsplit("@", 1)[0] + "@" if "@" in url.netloc else ""
    return urlunsplit(url._replace(netloc=f"{netloc}127.0.0.1:{proxy.port}"))


def test_duplicate_storm_from_payhook_send_is_applied_once(
    settings: Settings, factory: Factory, redis_server: RedisServer, tmp_path: Path
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    env = env_for(settings, redis_server.url)
    ingress = Ingress(env, tmp_path / "ingress.log")
    try:
        send = ["send", "--url", ingress.url(shop.endpoint_id), "--secret", shop.secret]
        send += ["--gateway-order-id", "pi_1", "--merchant-ref", "order-1", "--amount", "1999"]
        send += ["--copies", "20", "--concurrency", "10"]
        sent = subprocess.run(
            [sys.executable, "-m", "control.cli", *send],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        results = [json.loads(line) for line in sent.stdout.splitlines()]
        assert len(results) == 20 and {r["status"] for r in results} == {202}
        assert len({r["body"]["delivery_id"] for r in results}) == 20
        assert len({r["event_id"] for r in results}) == 1

        drain(env, tmp_path / "consumer.log")
        assert factory.order_state(shop, order_id) == "paid"
        assert factory.count("payment_event_receipts", tenant_id=shop.tenant_id) == 1
        assert factory.count("payment_outbox", order_id=order_id) == 1

        # One JSON line per request, naming its delivery, never the secret.
        lines = [line for line in ingress.lines() if line.get("event") == "webhook_received"]
        assert len(lines) == 20
        assert {line["delivery_id"] for line in lines} == {
            r["body"]["delivery_id"] for r in results
        }
        assert shop.secret not in ingress.log.read_text()
    finally:
        stop(ingress.proc)


def test_redis_stopped_answers_503_and_recovers_without_a_restart(
    settings: Settings, factory: Factory, redis_server: RedisServer, tmp_path: Path
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    ingress = Ingress(env_for(settings, redis_server.url), tmp_path / "ingress.log")
    redis = Redis.from_url(redis_server.url)
    try:
        before = ingress.post(shop.endpoint_id, StandardEvent(), shop.secret)
        assert before.status_code == 202

        redis_server.stop()
        for _ in range(5):
            refused = ingress.post(shop.endpoint_id, StandardEvent(), shop.secret)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert ingress.get("/readyz").status_code == 503

        # Paused rather than gone: slower than PAYHOOK_ENQUEUE_TIMEOUT is refused too.
        redis_server.start()
        assert redis_server.proc is not None
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            assert ingress.post(shop.endpoint_id, StandardEvent(), shop.secret).status_code == 503
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)

        # Same ingress process, Redis back: accepted again.
        wait_until(lambda: ingress.get("/readyz").status_code == 200, 15, "readyz after Redis")
        event = StandardEvent(gateway_order_id="pi_1")
        after = ingress.post(shop.endpoint_id, event, shop.secret)
        assert after.status_code == 202
        assert ingress.proc.poll() is None

        # Nothing half-written: exactly the two accepted jobs, each whole and queued.
        queued = {
            i.decode() for i in cast(list[bytes], redis.lrange(f"rq:queue:{settings.queue}", 0, -1))
        }
        accepted = {before.json()["delivery_id"], after.json()["delivery_id"]}
        keys = {k.decode().removeprefix("rq:job:") for k in redis.scan_iter("rq:job:*")}
        assert queued <= keys
        assert accepted <= queued
        assert all(redis.hget(f"rq:job:{k}", "status") == b"queued" for k in keys)
        drain(env_for(settings, redis_server.url), tmp_path / "consumer.log")
        assert factory.order_state(shop, order_id) == "paid"
    finally:
        stop(ingress.proc)
        redis.close()


def test_postgresql_unreachable_known_endpoints_keep_answering_202(
    settings: Settings,
    factory: Factory,
    redis_server: RedisServer,
    proxy: Proxy,
    tmp_path: Path,
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    env = env_for(settings, redis_server.url, database_url=via_proxy(settings, proxy))
    ingress = Ingress(env, tmp_path / "ingress.log")
    try:
        proxy.cut()
        wait_until(
            lambda: (
                'payhook_ingress_endpoint_refreshes_total{result="failed"}'
                in ingress.get("/metrics").text
            ),
            15,
            "a refresh to fail",
        )
        late = factory.shop()  # the ingress cannot learn it while PostgreSQL is away
        for _ in range(3):
            assert ingress.post(late.endpoint_id, StandardEvent(), late.secret).status_code == 404
        event = StandardEvent()
        assert ingress.post(shop.endpoint_id, event, shop.secret).status_code == 202
        assert ingress.get("/readyz").status_code == 200

        proxy.open()
        wait_until(
            lambda: ingress.post(late.endpoint_id, StandardEvent(), late.secret).status_code == 202,
            15,
            "the new endpoint once PostgreSQL is back",
        )
        drain(env_for(settings, redis_server.url), tmp_path / "consumer.log")
        assert factory.order_state(shop, order_id) == "paid"
    finally:
        stop(ingress.proc)
        proxy.cut()


def test_declared_oversized_body_is_refused_before_it_is_sent(
    settings: Settings, factory: Factory, redis_server: RedisServer, tmp_path: Path
) -> None:
    shop = factory.shop()
    ingress = Ingress(env_for(settings, redis_server.url), tmp_path / "ingress.log")
    try:
        with socket.create_connection(("127.0.0.1", ingress.port), timeout=10) as sock:
            sock.sendall(
                f"POST /webhooks/{shop.endpoint_id} HTTP/1.1\r\nhost: x\r\n"
                f"content-type: application/json\r\ncontent-length: {10**9}\r\n"
                f"expect: 100-continue\r\nwebhook-id: msg_{uuid.uuid4().hex}\r\n\r\n".encode()
            )
            answer = b""
            while chunk := sock.recv(4096):  # the server closes: nothing more is read
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert b"100 Continue" not in answer
    finally:
        stop(ingress.proc)
