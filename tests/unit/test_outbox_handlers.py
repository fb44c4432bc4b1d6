"""Delivery requests and how responses are classified, without a network."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import httpx
import pytest
import standardwebhooks
from structlog.testing import capture_logs

from outbox_worker import deadline
from outbox_worker.claims import Claim, short_error
from outbox_worker.config import OutboxSettings
from outbox_worker.handlers import (
    classify,
    deliver,
    delivery_body,
    delivery_headers,
    post_delivery,
)
from payhook.gateways import standard
from payhook.settings import Secret
from tests.factories import LOCAL_RECEIVERS

SECRET = standard.generate_secret()


def make_claim(url: str | None = "https://shop.example/fulfil", **changes: object) -> Claim:
    tenant_id, order_id = str(uuid.uuid4()), str(uuid.uuid4())
    payload = {
        "action": "fulfil_order",
        "tenant_id": tenant_id,
        "order_id": order_id,
        "merchant_reference": "order-1",
        "event_id": "msg_1",
        "state": "paid",
        "amount_minor": 1999,
        "currency": "EUR",
    }
    fields: dict[str, object] = {
        "tenant_id": tenant_id,
        "id": str(uuid.uuid4()),
        "order_id": order_id,
        "event_id": "msg_1",
        "action": "fulfil_order",
        "payload": payload,
        "attempts": 1,
        "token": str(uuid.uuid4()),
        "claimed_until": datetime.now(UTC),
        "fulfilment_url": url,
        "signing_secret": Secret(SECRET),
    }
    return Claim(**(fields | changes))  # type: ignore[arg-type]


def client(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_2xx_is_delivered(status: int) -> None:
    assert classify(status, None, 0).kind == "delivered"


@pytest.mark.parametrize("status", [408, 409, 425, 429, 500, 502, 503, 504, 599, 302, 101])
def test_transient_statuses_are_retried(status: int) -> None:
    outcome = classify(status, None, 0)
    assert outcome.kind == "retry" and outcome.error == f"HTTP {status}"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 410, 413, 422, 451, 499])
def test_other_4xx_are_permanent(status: int) -> None:
    assert classify(status, "30", 0).kind == "dead"


def test_retry_after_travels_with_a_retry() -> None:
    assert classify(429, "42", 0).retry_after == 42
    assert classify(503, None, 0).retry_after is None


def test_headers_carry_the_idempotency_key_and_a_verifiable_signature() -> None:
    claim = make_claim()
    body = delivery_body(claim)
    headers = delivery_headers(claim, body, timestamp=int(datetime.now(UTC).timestamp()))
    assert headers["idempotency-key"] == f"{claim.tenant_id}:msg_1:fulfil_order"
    assert headers["webhook-id"] == "msg_" + claim.id.replace("-", "")
    # The receiver's side: the reference Standard Webhooks library accepts it.
    verified = standardwebhooks.Webhook(SECRET).verify(body, headers)
    assert verified["order_id"] == claim.order_id


def test_a_tampered_body_does_not_verify() -> None:
    claim = make_claim()
    body = delivery_body(claim)
    headers = delivery_headers(claim, body, timestamp=int(datetime.now(UTC).timestamp()))
    with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError):
        standardwebhooks.Webhook(SECRET).verify(body.replace(b"1999", b"1"), headers)


def test_body_names_action_tenant_order_reference_and_event() -> None:
    claim = make_claim(payload={"currency": "EUR", "merchant_reference": "ref-9"})
    body = json.loads(delivery_body(claim))
    assert body == {
        "action": "fulfil_order",
        "tenant_id": claim.tenant_id,
        "order_id": claim.order_id,
        "merchant_reference": "ref-9",
        "event_id": "msg_1",
        "currency": "EUR",
    }


def test_http_handler_posts_once_to_the_tenant_url() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(202)

    claim = make_claim()
    outcome = deliver(client(answer), claim)
    assert (outcome.kind, outcome.handler, outcome.status) == ("delivered", "http", 202)
    assert [str(r.url) for r in seen] == ["https://shop.example/fulfil"]
    assert seen[0].method == "POST" and seen[0].headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("exc", "prefix"),
    [
        (httpx.ConnectTimeout("timed out"), "timeout: ConnectTimeout"),
        (httpx.ReadTimeout("timed out"), "timeout: ReadTimeout"),
        (httpx.ConnectError("[Errno 111] Connection refused"), "connection error: ConnectError"),
        (httpx.RemoteProtocolError("server disconnected"), "connection error:"),
    ],
)
def test_network_failures_are_retried(exc: Exception, prefix: str) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise exc

    outcome = deliver(client(fail), make_claim())
    assert outcome.kind == "retry" and outcome.error is not None
    assert outcome.error.startswith(prefix)


def test_unusable_url_is_permanent_and_not_repeated_in_the_error() -> None:
    claim = make_claim(url="ftp://user:hunter2@shop.example/x")
    outcome = deliver(httpx.Client(), claim)
    assert outcome.kind == "dead" and outcome.error is not None
    assert "hunter2" not in outcome.error


@pytest.mark.parametrize(
    "host", [f"{'a' * 64}.shop.example", "shop..example", f"{'é' * 60}.example"]
)
def test_a_host_no_resolver_takes_is_permanent(host: str) -> None:
    # Found by the resolver's IDNA encoding, before any lookup is sent.
    outcome = deliver(httpx.Client(), make_claim(url=f"https://{host}/fulfil"))
    assert (outcome.kind, outcome.error) == ("dead", "fulfilment URL is not a usable http(s) URL")


def test_tenant_without_url_is_logged_not_posted() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError("the log handler must not post")

    claim = make_claim(url=None)
    with capture_logs() as logs:
        outcome = deliver(client(refuse), claim)
    assert (outcome.kind, outcome.handler) == ("delivered", "log")
    [line] = [entry for entry in logs if entry["event"] == "outbox_logged"]
    assert line["idempotency_key"] == claim.idempotency_key
    assert "payload" not in line and SECRET not in repr(line)


def test_missing_tenant_is_dead() -> None:
    outcome = deliver(httpx.Client(), make_claim(signing_secret=None))
    assert (outcome.kind, outcome.error) == ("dead", "tenant not found")


def test_a_tenant_secret_that_does_not_open_is_retried_not_sent_unsigned() -> None:
    """The right key may yet be configured: the row waits for it."""
    error = "a secret sealed under key k1 does not open"
    outcome = deliver(httpx.Client(), make_claim(signing_secret=None, secret_error=error))
    assert outcome.kind == "retry" and outcome.error == f"tenant signing secret: {error}"


def test_claim_repr_hides_the_signing_secret() -> None:
    assert SECRET not in repr(make_claim())


def test_errors_are_stored_short_and_on_one_line() -> None:
    assert short_error("a\n  b\tc") == "a b c"
    assert len(short_error("x" * 1000)) == 300


def test_an_endless_response_body_is_not_read_to_the_end() -> None:
    class Endless(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            while True:
                yield b"x" * 4096

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Endless())

    assert deliver(client(answer), make_claim()).kind == "delivered"


def test_a_response_body_cut_short_does_not_undo_a_2xx() -> None:
    class Cut(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield b'{"ok":'
            raise httpx.ReadError("connection reset")

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Cut())

    assert deliver(client(answer), make_claim()).kind == "delivered"


class TricklingReceiver:
    """A receiver that answers one byte every `pause` seconds; counts what it got out."""

    ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nx-padding: " + b"." * 60 + b"\r\n\r\n"

    def __init__(self, pause: float = 0.05) -> None:
        self.pause = pause
        self.sent = 0
        self.done = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/fulfil"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        connection, _ = self.server.accept()
        with connection:
            _read_request(connection)
            try:
                for byte in self.ANSWER:
                    connection.sendall(bytes([byte]))
                    self.sent += 1
                    time.sleep(self.pause)
            except OSError:
                pass  # the client hung up
            self.done.set()

    def close(self) -> None:
        self.server.close()


def _read_request(connection: socket.socket) -> None:
    """The whole request, so that closing afterwards does not reset the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += connection.recv(65536)


def test_a_receiver_trickling_its_answer_is_cut_off_at_the_deadline() -> None:
    """Each read arrives well within the timeout, so only a deadline on the whole
    exchange stops it: without one this delivery would take four seconds and
    succeed, long past the lease it was started in."""
    receiver = TricklingReceiver()
    limits = httpx.Limits(max_connections=1)
    with httpx.Client(timeout=0.5, transport=deadline.build_transport(limits)) as client:
        started = time.monotonic()
        with deadline.within(started + 0.6):
            outcome = post_delivery(client, make_claim(receiver.url))
    assert outcome.kind == "retry" and outcome.error == "timeout: ReadTimeout", outcome
    receiver.done.wait(5)
    receiver.close()
    assert receiver.sent < len(TricklingReceiver.ANSWER), "the whole answer was read"


def test_without_a_deadline_the_transport_keeps_httpx_timeouts() -> None:
    receiver = TricklingReceiver(pause=0)
    with httpx.Client(timeout=2, transport=deadline.build_transport(httpx.Limits())) as client:
        assert deadline.current() is None
        outcome = post_delivery(client, make_claim(receiver.url))
    receiver.close()
    assert outcome.kind == "delivered"


def test_the_worker_client_has_the_deadline_unless_a_proxy_is_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outbox_worker.main import build_client

    config = OutboxSettings(timeout=0.5, destinations=LOCAL_RECEIVERS)
    monkeypatch.setattr(urllib.request, "getproxies", dict)
    receiver = TricklingReceiver()
    with build_client(config) as client, deadline.within(time.monotonic() + 0.6):
        assert post_delivery(client, make_claim(receiver.url)).kind == "retry"
    receiver.close()

    monkeypatch.setattr(urllib.request, "getproxies", lambda: {"https": "http://proxy:3128"})
    with capture_logs() as logs, build_client(config):
        pass
    assert [entry["event"] for entry in logs] == ["outbox_proxy_from_environment"]

    # NO_PROXY alone (as in many container images), an FTP or SOCKS proxy
    # httpx ignores, or NO_PROXY=*: no proxy, so the deadline stays.
    for found in (
        {"no": "localhost,.internal"},
        {"ftp": "http://proxy:21", "socks": "socks5://proxy:1080"},
        {"https": "http://proxy:3128", "no": "*"},
    ):
        monkeypatch.setattr(urllib.request, "getproxies", lambda found=found: found)
        receiver = TricklingReceiver()
        with (
            capture_logs() as logs,
            build_client(config) as client,
            deadline.within(time.monotonic() + 0.6),
        ):
            assert post_delivery(client, make_claim(receiver.url)).kind == "retry", found
        receiver.close()
        assert logs == [], found
