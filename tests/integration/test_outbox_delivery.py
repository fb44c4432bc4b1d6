"""The worker loop in this process against a real receiver process and real PostgreSQL."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import standardwebhooks
from structlog.testing import capture_logs

from consumer.handler import Runtime, handle
from outbox_worker import deadline
from outbox_worker.claims import Claim
from outbox_worker.config import OutboxSettings
from outbox_worker.handlers import Outcome
from outbox_worker.loop import Worker
from outbox_worker.main import build_client
from payhook import destinations
from payhook.db import Pool, Row, create_pool
from payhook.destinations import DestinationPolicy
from payhook.sealing import tenant_aad
from payhook.settings import Settings
from tests.factories import LOCAL_RECEIVERS, TEST_KEYRING, Factory, Shop, StandardEvent
from tests.receiver import Receiver

#: Short enough that retries come quickly in a test.
FAST = OutboxSettings(lease=30, batch=10, concurrency=4, poll=0.2, timeout=2, backoff=0.05)


@pytest.fixture
def pool(settings: Settings) -> Iterator[Pool]:
    pool = create_pool(settings, "test", size=4)
    pool.open(wait=True)
    yield pool
    pool.close()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver") as receiver:
        yield receiver


MakeWorker = Callable[..., Worker]


@pytest.fixture
def make_worker(pool: Pool) -> Iterator[MakeWorker]:
    """Workers on the test's pool; their threads and HTTP clients are closed afterwards."""
    made: list[Worker] = []

    def make(
        config: OutboxSettings, destinations: DestinationPolicy = LOCAL_RECEIVERS, **options: Any
    ) -> Worker:
        # The test's receivers are on this machine, over http.
        config = replace(config, destinations=destinations)
        worker = Worker(pool, build_client(config), config, keyring=TEST_KEYRING, **options)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.client.close()


def add_rows(conn: psycopg.Connection[Row], shop: Shop, order_id: str, count: int = 1) -> list[str]:
    return Factory(conn).outbox_rows(shop, order_id, count)


def row(conn: psycopg.Connection[Row], row_id: str) -> dict[str, Any]:
    return Factory(conn).outbox_row(row_id)


def run_until(worker: Worker, done: Any, timeout: float = 20) -> None:
    """Run passes of the worker until `done()` is true."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the worker did not get there"
        worker.run_once()
        time.sleep(0.02)


def signing_secret(conn: psycopg.Connection[Row], shop: Shop) -> str:
    found = conn.execute(
        "SELECT signing_secret FROM payhook.tenants WHERE id = %s", (shop.tenant_id,)
    ).fetchone()
    assert found is not None
    return TEST_KEYRING.open(found["signing_secret"], tenant_aad(shop.tenant_id))


def test_delivery_is_a_signed_post_with_the_idempotency_key(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    shop = factory.shop(fulfilment_url=receiver.url)
    order_id = factory.order(shop)
    [row_id] = add_rows(conn, shop, order_id)
    worker = make_worker(FAST)
    with capture_logs() as logs:
        assert worker.run_once() == 1

    [request] = receiver.requests()
    stored = row(conn, row_id)
    assert stored["state"] == "delivered" and stored["delivered_at"] is not None
    assert stored["attempts"] == 1 and stored["claim_token"] is None
    headers = request["headers"]
    assert headers["idempotency-key"] == f"{shop.tenant_id}:{stored['event_id']}:fulfil_order"
    body = request["body"].encode()
    verified = standardwebhooks.Webhook(signing_secret(conn, shop)).verify(body, headers)
    assert verified == {
        "action": "fulfil_order",
        "tenant_id": shop.tenant_id,
        "order_id": order_id,
        "merchant_reference": "order-1",
        "event_id": stored["event_id"],
    }
    [line] = [entry for entry in logs if entry["event"] == "outbox_delivered"]
    assert line["outbox_id"] == row_id and line["status"] == 200 and line["handler"] == "http"


def test_event_applied_by_the_consumer_reaches_the_fulfilment_url(
    settings: Settings, factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    """The whole path: a signed gateway event, the consumer transaction, the outbox worker."""
    shop = factory.shop(fulfilment_url=receiver.url)
    order_id = factory.order(shop, amount=2500)
    event = StandardEvent(amount=2500)
    runtime = Runtime(settings=settings, pool=create_pool(settings, "test", size=1))
    runtime.pool.open(wait=True)
    assert handle(runtime, factory.standard_envelope(shop, event).to_json()).outcome == "applied"
    runtime.pool.close()

    worker = make_worker(FAST)
    worker.run_once()
    [request] = receiver.requests()
    assert request["headers"]["idempotency-key"] == (
        f"{shop.tenant_id}:{event.event_id}:fulfil_order"
    )
    assert json.loads(request["body"]) == {
        "action": "fulfil_order",
        "tenant_id": shop.tenant_id,
        "order_id": order_id,
        "merchant_reference": "order-1",
        "event_id": event.event_id,
        "state": "paid",
        "amount_minor": 2500,
        "refunded_minor": 0,
        "currency": "EUR",
    }


def test_400_is_dead_at_once_and_never_retried(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    receiver.configure(status=400)
    shop = factory.shop(fulfilment_url=receiver.url)
    [row_id] = add_rows(conn, shop, factory.order(shop))
    worker = make_worker(FAST)
    with capture_logs() as logs:
        worker.run_once()
    receiver.configure(status=200)
    time.sleep(FAST.backoff * 4)  # longer than any retry would have waited
    assert worker.run_once() == 0

    stored = row(conn, row_id)
    assert (stored["state"], stored["attempts"], stored["last_error"]) == ("dead", 1, "HTTP 400")
    assert stored["delivered_at"] is None
    assert len(receiver.requests()) == 1
    assert [e["event"] for e in logs if e["event"].startswith("outbox_")] == ["outbox_dead"]


def test_5xx_is_retried_with_backoff_then_delivered(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    receiver.configure(statuses=[500, 503])
    shop = factory.shop(fulfilment_url=receiver.url)
    [row_id] = add_rows(conn, shop, factory.order(shop))
    config = OutboxSettings(lease=30, poll=0.2, timeout=2, backoff=0.3, backoff_max=0.3)
    worker = make_worker(config)
    worker.run_once()
    after_first = row(conn, row_id)
    assert after_first["state"] == "pending" and after_first["last_error"] == "HTTP 500"
    assert after_first["due_in"].total_seconds() > 0, "the retry waits for its backoff"
    assert worker.run_once() == 0, "not due again before the backoff"

    run_until(worker, lambda: row(conn, row_id)["state"] == "delivered")
    stored = row(conn, row_id)
    assert stored["attempts"] == 3 and stored["last_error"] == "HTTP 503"
    assert [r["status"] for r in receiver.requests()] == [500, 503, 200]
    assert len(set(receiver.keys())) == 1, "every attempt carries the same Idempotency-Key"


def test_429_retry_after_is_honoured(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    receiver.configure(status=429, retry_after="120")
    shop = factory.shop(fulfilment_url=receiver.url)
    [row_id] = add_rows(conn, shop, factory.order(shop))
    worker = make_worker(FAST)
    worker.run_once()
    stored = row(conn, row_id)
    assert stored["state"] == "pending" and stored["last_error"] == "HTTP 429"
    assert stored["due_in"].total_seconds() > 110, "Retry-After beats the 50 ms backoff"


def test_timeout_is_retried(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    receiver.configure(delay=3)
    shop = factory.shop(fulfilment_url=receiver.url)
    [row_id] = add_rows(conn, shop, factory.order(shop))
    worker = make_worker(OutboxSettings(lease=5, timeout=0.5, backoff=60, backoff_max=60))
    worker.run_once()
    stored = row(conn, row_id)
    assert stored["state"] == "pending" and stored["last_error"] == "timeout: ReadTimeout"
    assert len(receiver.requests()) == 1


def test_connection_refused_is_retried(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    shop = factory.shop(fulfilment_url=receiver.url)
    receiver.stop()
    [row_id] = add_rows(conn, shop, factory.order(shop))
    worker = make_worker(FAST)
    worker.run_once()
    stored = row(conn, row_id)
    assert stored["state"] == "pending" and stored["attempts"] == 1
    assert stored["last_error"].startswith("connection error: ConnectError")


def test_last_allowed_attempt_makes_the_row_dead(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    receiver.configure(status=502)
    shop = factory.shop(fulfilment_url=receiver.url)
    [row_id] = add_rows(conn, shop, factory.order(shop))
    config = OutboxSettings(lease=30, timeout=2, max_attempts=3, backoff=0.05, backoff_max=0.1)
    worker = make_worker(config)
    run_until(worker, lambda: row(conn, row_id)["state"] == "dead")
    time.sleep(0.2)
    assert worker.run_once() == 0
    stored = row(conn, row_id)
    assert stored["attempts"] == 3
    assert stored["last_error"] == "gave up after 3 attempts: HTTP 502"
    assert len(receiver.requests()) == 3


def test_tenant_without_url_gets_the_log_handler(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    shop = factory.shop(fulfilment_url=None)
    [row_id] = add_rows(conn, shop, factory.order(shop))
    worker = make_worker(FAST)
    with capture_logs() as logs:
        worker.run_once()
    assert row(conn, row_id)["state"] == "delivered"
    assert receiver.requests() == []
    events = [e for e in logs if e["event"] in {"outbox_logged", "outbox_delivered"}]
    assert [(e["event"], e.get("handler")) for e in events] == [
        ("outbox_logged", None),
        ("outbox_delivered", "log"),
    ]


def test_stopping_worker_releases_claimed_rows_it_has_not_started(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    shop = factory.shop(fulfilment_url=receiver.url)
    ids = add_rows(conn, shop, factory.order(shop), 3)
    worker = make_worker(FAST)
    worker.stop()
    assert worker.run_batch() == 3  # claimed, then given back unattempted
    for row_id in ids:
        stored = row(conn, row_id)
        assert stored["state"] == "pending" and stored["attempts"] == 0
        assert stored["claim_token"] is None and stored["due_in"].total_seconds() <= 0
    assert receiver.requests() == []


def test_row_is_not_started_without_a_full_delivery_left_in_its_lease(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker
) -> None:
    """Rows queued behind a slow delivery are released rather than sent late in the lease."""
    shop = factory.shop(fulfilment_url="http://127.0.0.1:9/unused")
    ids = add_rows(conn, shop, factory.order(shop), 2)
    started: list[str] = []

    def slow_delivery(client: httpx.Client, claim: Claim) -> Outcome:
        started.append(claim.id)
        time.sleep(1.5)  # leaves less than 2 x timeout of the 3 s lease
        return Outcome("delivered", "test")

    config = OutboxSettings(lease=3, batch=2, concurrency=1, timeout=1)
    worker = make_worker(config, deliver=slow_delivery)
    assert worker.run_batch() == 2
    [first] = started
    [second] = [i for i in ids if i != first]
    assert row(conn, first)["state"] == "delivered"
    late = row(conn, second)
    assert late["state"] == "pending" and late["attempts"] == 0 and late["claim_token"] is None


def test_row_is_not_started_without_time_left_to_record_its_result(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker
) -> None:
    """A delivery ending with the lease would have its result refused as stale
    and the row sent again by the worker that took it over: the second row,
    with a little more than two timeouts left, is released."""
    shop = factory.shop(fulfilment_url="http://127.0.0.1:9/unused")
    ids = add_rows(conn, shop, factory.order(shop), 2)
    started: list[str] = []
    ended: list[float] = []

    def delivery(client: httpx.Client, claim: Claim) -> Outcome:
        started.append(claim.id)
        time.sleep(0.7)  # leaves about 2.3 s of the 3 s lease: budget 2 s, margin 0.5 s
        ended.append(time.monotonic())
        return Outcome("delivered", "test")

    config = OutboxSettings(lease=3, batch=2, concurrency=1, timeout=1)
    worker = make_worker(config, deliver=delivery)
    before = time.monotonic()
    assert worker.run_batch() == 2
    # The premise: without the margin, the second row had time enough to start.
    assert before + config.lease - ended[0] > 2 * config.timeout
    [first] = started
    [second] = [i for i in ids if i != first]
    assert row(conn, first)["state"] == "delivered"
    late = row(conn, second)
    assert late["state"] == "pending" and late["attempts"] == 0 and late["claim_token"] is None


def test_row_whose_last_attempt_was_lost_with_its_worker_is_dead_not_resent(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    """A worker died during the last allowed attempt: the takeover gives up, it does not send."""
    shop = factory.shop(fulfilment_url=receiver.url)
    [row_id] = add_rows(conn, shop, factory.order(shop))
    conn.execute("UPDATE payhook.payment_outbox SET attempts = 3 WHERE id = %s", (row_id,))
    worker = make_worker(OutboxSettings(lease=30, timeout=2, max_attempts=3))
    worker.run_once()
    stored = row(conn, row_id)
    assert (stored["state"], stored["attempts"]) == ("dead", 4)
    assert stored["last_error"] == "worker lost during the last attempt"
    assert receiver.requests() == []


def test_handler_crash_is_recorded_as_a_failed_attempt(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker
) -> None:
    shop = factory.shop(fulfilment_url="http://127.0.0.1:9/unused")
    [row_id] = add_rows(conn, shop, factory.order(shop))

    def broken(client: httpx.Client, claim: Claim) -> Outcome:
        raise KeyError("surprise")

    config = OutboxSettings(lease=30, timeout=2, backoff=60, backoff_max=60)
    worker = make_worker(config, deliver=broken)
    with capture_logs() as logs:
        worker.run_once()
    stored = row(conn, row_id)
    assert stored["state"] == "pending" and stored["claim_token"] is None
    assert stored["last_error"] == "handler failed: KeyError"
    assert stored["due_in"].total_seconds() > 25, "retried on the backoff, not the lease"
    assert "outbox_handler_failed" in [e["event"] for e in logs]


def test_deliveries_reuse_one_connection(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    """The response is read, so keep-alive works: no TCP handshake per delivery."""
    receiver.configure(statuses=[503])
    shop = factory.shop(fulfilment_url=receiver.url)
    add_rows(conn, shop, factory.order(shop), 5)
    worker = make_worker(OutboxSettings(lease=30, batch=5, concurrency=1, timeout=2))
    worker.run_once()
    requests = receiver.requests()
    assert [r["status"] for r in requests] == [503, 200, 200, 200, 200]
    assert len({r["client_port"] for r in requests}) == 1


def test_a_delivery_runs_under_a_deadline_inside_its_lease(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker
) -> None:
    """The exchange must end within the budget the lease was checked for
    (`outbox_worker.deadline` enforces it on every socket operation)."""
    shop = factory.shop(fulfilment_url="http://127.0.0.1:9/unused")
    add_rows(conn, shop, factory.order(shop))
    seen: list[tuple[float, float | None]] = []

    def record(client: httpx.Client, claim: Claim) -> Outcome:
        seen.append((time.monotonic(), deadline.current()))
        return Outcome("delivered", "test")

    config = OutboxSettings(lease=30, timeout=2)
    before = time.monotonic()
    make_worker(config, deliver=record).run_once()
    [(started, until)] = seen
    assert until is not None, "delivered without a deadline"
    assert started < until <= started + 2 * config.timeout <= before + config.lease


def test_connections_the_server_ended_do_not_fail_a_pass(
    conn: psycopg.Connection[Row],
    factory: Factory,
    make_worker: MakeWorker,
    receiver: Receiver,
    pool: Pool,
) -> None:
    """After a restart the pool holds connections the server ended. Met one
    at a time, each failed a pass of the loop and doubled its wait (0.5 s up
    to 15 s): rows stayed pending for half a minute after PostgreSQL was
    back. Every pooled connection is ended here, so the claim needs a new one."""
    shop = factory.shop(fulfilment_url=receiver.url)
    [row_id] = add_rows(conn, shop, factory.order(shop))
    held = [pool.getconn() for _ in range(pool.max_size)]
    pids = [c.info.backend_pid for c in held]
    for c in held:
        pool.putconn(c)
    factory.end_backends(pids)
    worker = make_worker(FAST)
    with capture_logs() as logs:
        assert worker.run_once() == 1
    assert row(conn, row_id)["state"] == "delivered"
    assert len(receiver.requests()) == 1
    assert not [e for e in logs if e["log_level"] == "error"], logs


#: The worker's policy in the tests below: http allowed, no network allowed.
NO_LOCAL_RECEIVERS = DestinationPolicy(allow_insecure=True)


def shop_at(conn: psycopg.Connection[Row], factory: Factory, url: str) -> Shop:
    """A shop whose fulfilment URL is written to the table as it is: unchecked,
    and with no name resolved (tests send nothing beyond this machine)."""
    shop = factory.shop()
    conn.execute(
        "UPDATE payhook.tenants SET fulfilment_url = %s WHERE id = %s", (url, shop.tenant_id)
    )
    return shop


def test_a_host_that_resolves_to_a_loopback_address_is_refused_and_nothing_is_sent(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    """`localhost` passes a check of the URL's form; only its resolution, at
    delivery, shows where it leads. The row is dead at once: retrying sends nothing."""
    shop = factory.shop(fulfilment_url=f"http://localhost:{receiver.port}/fulfil")
    [row_id] = add_rows(conn, shop, factory.order(shop))
    worker = make_worker(FAST, destinations=NO_LOCAL_RECEIVERS)
    with capture_logs() as logs:
        assert worker.run_once() == 1
    stored = row(conn, row_id)
    assert (stored["state"], stored["attempts"]) == ("dead", 1)
    assert stored["last_error"].startswith("destination refused: ")
    assert "is a loopback address" in stored["last_error"]
    assert "PAYHOOK_FULFILMENT_ALLOW_NETWORKS" in stored["last_error"]
    assert receiver.requests() == []
    [line] = [e for e in logs if e["event"] == "outbox_dead"]
    assert line["outbox_id"] == row_id


def test_a_name_resolving_to_a_private_address_is_refused_at_delivery(
    conn: psycopg.Connection[Row],
    factory: Factory,
    make_worker: MakeWorker,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tenant's name resolved to a public address when it was added, and
    to the receiver's loopback address at delivery (DNS rebinding)."""
    shop = shop_at(conn, factory, f"http://shop.example:{receiver.port}/fulfil")
    [row_id] = add_rows(conn, shop, factory.order(shop))
    asked: list[str] = []

    def rebound(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(destinations, "resolve_host", rebound)
    worker = make_worker(FAST, destinations=NO_LOCAL_RECEIVERS)
    worker.run_once()
    stored = row(conn, row_id)
    assert stored["state"] == "dead" and asked == ["shop.example"]
    assert "127.0.0.1 is a loopback address" in stored["last_error"]
    assert receiver.requests() == []


def test_the_connection_goes_to_the_address_that_was_checked(
    conn: psycopg.Connection[Row],
    factory: Factory,
    make_worker: MakeWorker,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The name is resolved once, by the check; the connection is made to the
    address it returned, so no second answer can lead it elsewhere."""
    shop = shop_at(conn, factory, f"http://shop.example:{receiver.port}/fulfil")
    [row_id] = add_rows(conn, shop, factory.order(shop))
    monkeypatch.setattr(destinations, "resolve_host", lambda host, port: ["127.0.0.1"])
    real_getaddrinfo = socket.getaddrinfo

    def no_second_lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        assert host != "shop.example", "the name was resolved again to connect"
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", no_second_lookup)
    make_worker(FAST).run_once()
    assert row(conn, row_id)["state"] == "delivered"
    [request] = receiver.requests()
    assert request["headers"]["host"] == f"shop.example:{receiver.port}"


def test_a_redirect_is_never_followed(
    conn: psycopg.Connection[Row],
    factory: Factory,
    make_worker: MakeWorker,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    """A 302 to an address the worker may reach is not followed either: only
    the tenant's own URL is ever asked."""
    with Receiver(tmp_path / "redirector", status=302) as redirector:
        redirector.configure(location=receiver.url)
        shop = factory.shop(fulfilment_url=redirector.url)
        [row_id] = add_rows(conn, shop, factory.order(shop))
        make_worker(FAST).run_once()
        assert len(redirector.requests()) == 1
    stored = row(conn, row_id)
    assert (stored["state"], stored["last_error"]) == ("pending", "HTTP 302")
    assert receiver.requests() == []


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://user:s3cr3t@127.0.0.1:{port}/fulfil", "the URL carries credentials"),
        ("http://0x7f000001:{port}/fulfil", "127.0.0.1 is a loopback address"),
        ("http://[::ffff:127.0.0.1]:{port}/fulfil", "is an IPv4-mapped address"),
    ],
)
def test_a_refused_url_is_dead_and_never_sent(
    conn: psycopg.Connection[Row],
    factory: Factory,
    make_worker: MakeWorker,
    receiver: Receiver,
    url: str,
    reason: str,
) -> None:
    """Stored before the policy, or written to the table by hand: the worker
    checks every delivery itself."""
    shop = shop_at(conn, factory, url.format(port=receiver.port))
    [row_id] = add_rows(conn, shop, factory.order(shop))
    make_worker(FAST, destinations=NO_LOCAL_RECEIVERS).run_once()
    stored = row(conn, row_id)
    assert stored["state"] == "dead" and reason in stored["last_error"]
    assert "s3cr3t" not in stored["last_error"]
    assert receiver.requests() == []


def test_plain_http_is_refused_without_the_insecure_flag(
    conn: psycopg.Connection[Row], factory: Factory, make_worker: MakeWorker, receiver: Receiver
) -> None:
    shop = factory.shop(fulfilment_url=receiver.url)
    [row_id] = add_rows(conn, shop, factory.order(shop))
    local_https_only = replace(LOCAL_RECEIVERS, allow_insecure=False)
    make_worker(FAST, destinations=local_https_only).run_once()
    stored = row(conn, row_id)
    assert stored["state"] == "dead"
    assert "PAYHOOK_ALLOW_INSECURE_FULFILMENT=1" in stored["last_error"]
    assert receiver.requests() == []
