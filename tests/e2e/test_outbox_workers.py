"""`payhook outbox-worker` processes against a real receiver process and real PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from consumer.handler import Runtime, handle
from payhook.db import Row, create_pool, execute
from payhook.settings import Settings
from tests.conftest import PG_SERVER
from tests.factories import LOCAL_RECEIVER_SETTINGS, TEST_SECRETS_KEY, Factory, Shop, StandardEvent
from tests.receiver import Receiver

#: Seconds any one wait in these tests may take before the test fails.
PATIENCE = 60.0


class WorkerProcess:
    """One `payhook outbox-worker` process; its JSON log (stdout) and stderr in files."""

    def __init__(
        self,
        database: str,
        log: Path,
        *args: str,
        extra_env: Callable[[str], dict[str, str]] | None = None,
        **settings: str,
    ) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAYHOOK_")}
        env |= {
            "DATABASE_URL": f"{PG_SERVER}/{database}",
            "PAYHOOK_LOG_LEVEL": "INFO",
            "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
        }
        env |= LOCAL_RECEIVER_SETTINGS
        env |= extra_env(database) if extra_env is not None else {}
        env |= {f"PAYHOOK_OUTBOX_{name.upper()}": value for name, value in settings.items()}
        script = Path(sys.executable).with_name("payhook")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "control.cli"]
        self.log = log
        self.errors = log.with_suffix(".err")
        with log.open("ab") as out, self.errors.open("ab") as err:
            self.process = subprocess.Popen(
                [*command, "outbox-worker", *args], env=env, stdout=out, stderr=err
            )

    def lines(self) -> list[dict[str, Any]]:
        result = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                result.append(json.loads(line))
        return result

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line.get("event") == name]

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = PATIENCE) -> int:
        return self.process.wait(timeout=timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver") as receiver:
        yield receiver


@pytest.fixture
def worker_env() -> Callable[[str], dict[str, str]] | None:
    """More of the workers' environment, for a database's name (none here;
    tests/e2e/test_pgbouncer.py puts PgBouncer in between)."""
    return None


@pytest.fixture
def workers(
    database: str, tmp_path: Path, worker_env: Callable[[str], dict[str, str]] | None
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(*args: str, **settings: str) -> WorkerProcess:
        log = tmp_path / f"worker-{len(started)}.log"
        worker = WorkerProcess(database, log, *args, extra_env=worker_env, **settings)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def wait_until(check: Callable[[], object], what: str, timeout: float = PATIENCE) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def add_rows(conn: psycopg.Connection[Row], shop: Shop, count: int) -> list[str]:
    """`count` due rows for one order of `shop`, committed together; their idempotency keys."""
    order_id = str(uuid.uuid4())
    keys = []
    with conn.transaction():
        execute(
            conn,
            "insert_order",
            {
                "tenant_id": shop.tenant_id,
                "id": order_id,
                "merchant_reference": f"order-{order_id}",
                "gateway_order_id": f"pi_{order_id}",
                "amount_minor": 1000,
                "currency": "EUR",
            },
        )
        for _ in range(count):
            event_id = f"msg_{uuid.uuid4().hex}"
            execute(
                conn,
                "insert_outbox",
                {
                    "id": uuid.uuid4(),
                    "tenant_id": shop.tenant_id,
                    "order_id": order_id,
                    "event_id": event_id,
                    "action": "fulfil_order",
                    "payload": Jsonb({"merchant_reference": f"order-{order_id}"}),
                },
            )
            keys.append(f"{shop.tenant_id}:{event_id}:fulfil_order")
    return keys


def count(conn: psycopg.Connection[Row], state: str) -> int:
    found = conn.execute(
        "SELECT count(*) AS n FROM payhook.payment_outbox WHERE state = %s", (state,)
    ).fetchone()
    assert found is not None
    return int(found["n"])


def outbox(conn: psycopg.Connection[Row]) -> list[dict[str, Any]]:
    return conn.execute(
        "SELECT *, tenant_id || ':' || event_id || ':' || action AS key,"
        " extract(epoch FROM claimed_until)::float8 AS lease_end"
        " FROM payhook.payment_outbox ORDER BY created_at, id"
    ).fetchall()


def listeners(conn: psycopg.Connection[Row]) -> int:
    """Worker connections currently listening on the outbox channel."""
    found = conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'payhook-outbox-listen' AND query ILIKE 'LISTEN%%'"
    ).fetchone()
    assert found is not None
    return int(found["n"])


@pytest.mark.slow
def test_three_workers_deliver_500_rows_each_exactly_once(
    conn: psycopg.Connection[Row], factory: Factory, receiver: Receiver, workers: Any
) -> None:
    """3 processes compete for 500 rows: every row delivered, 500 distinct keys, none twice."""
    receiver.configure(delay=0.02)
    shops = [factory.shop(fulfilment_url=receiver.url) for _ in range(3)]
    procs = [workers(lease="60s", batch="5", concurrency="3", poll="1s") for _ in range(3)]
    wait_until(lambda: listeners(conn) == 3, "all three workers listen")

    keys = [key for n, shop in enumerate(shops) for key in add_rows(conn, shop, (167, 167, 166)[n])]
    assert len(keys) == 500
    wait_until(lambda: count(conn, "delivered") == 500, "every row is delivered")
    for proc in procs:
        proc.signal(signal.SIGTERM)
    assert [proc.wait() for proc in procs] == [0, 0, 0]

    seen = receiver.keys()
    assert sorted(seen) == sorted(keys), "each idempotency key exactly once"
    rows = outbox(conn)
    assert {(r["state"], r["attempts"]) for r in rows} == {("delivered", 1)}
    assert all(r["delivered_at"] is not None and r["claim_token"] is None for r in rows)
    per_worker = [len(proc.events("outbox_delivered")) for proc in procs]
    assert sum(per_worker) == 500 and all(per_worker), per_worker
    for proc in procs:
        assert not proc.events("outbox_claim_stale") and not proc.events("outbox_retry_scheduled")


@pytest.mark.slow
def test_sigkilled_worker_rows_are_taken_over_after_the_lease(
    conn: psycopg.Connection[Row], factory: Factory, receiver: Receiver, workers: Any
) -> None:
    """The receiver sees the same Idempotency-Key again: at-least-once, effectively once."""
    receiver.configure(delay=60)  # every delivery hangs until the worker dies
    shop = factory.shop(fulfilment_url=receiver.url)
    keys = add_rows(conn, shop, 3)
    settings = {"lease": "6s", "timeout": "2s", "batch": "3", "concurrency": "3"}
    first = workers(**settings)
    wait_until(lambda: len(receiver.requests()) == 3, "the first worker is mid-delivery")
    first.signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    receiver.configure(delay=0)
    claimed = outbox(conn)
    assert {r["state"] for r in claimed} == {"pending"}
    assert all(r["claim_token"] is not None for r in claimed), "the dead worker's claims remain"

    second = workers(**settings)
    wait_until(lambda: count(conn, "delivered") == 3, "the rows are taken over and delivered")
    second.signal(signal.SIGTERM)
    assert second.wait() == 0

    requests = receiver.requests()
    assert Counter(r["headers"]["idempotency-key"] for r in requests) == dict.fromkeys(keys, 2)
    lease_end = {r["key"]: r["lease_end"] for r in claimed}
    for request in requests[3:]:
        key = request["headers"]["idempotency-key"]
        assert request["t"] >= lease_end[key], "taken over only once the lease had ended"
    assert {r["attempts"] for r in outbox(conn)} == {2}
    assert not second.events("outbox_claim_stale")


@pytest.mark.slow
def test_rows_are_retried_while_the_receiver_is_down_and_delivered_when_it_returns(
    conn: psycopg.Connection[Row], factory: Factory, receiver: Receiver, workers: Any
) -> None:
    shop = factory.shop(fulfilment_url=receiver.url)
    receiver.stop()
    keys = add_rows(conn, shop, 5)
    worker = workers(
        backoff="100ms", backoff_max="800ms", timeout="1s", lease="5s", max_attempts="100"
    )
    wait_until(
        lambda: all(r["attempts"] >= 4 for r in outbox(conn)), "every row failed several times"
    )
    for row in outbox(conn):
        assert row["state"] == "pending" and row["delivered_at"] is None
        assert row["last_error"].startswith("connection error: ConnectError")

    receiver.start()  # on the same port
    wait_until(lambda: count(conn, "delivered") == 5, "every row is delivered")
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0

    assert sorted(receiver.keys()) == sorted(keys)
    retries = worker.events("outbox_retry_scheduled")
    by_attempt: dict[int, list[float]] = {}
    for line in retries:
        by_attempt.setdefault(line["attempt"], []).append(line["retry_in"])
    # Exponential with jitter: attempt n waits within [ceiling/2, ceiling], the
    # ceiling doubling from 100 ms and capped at 800 ms.
    for attempt, delays in by_attempt.items():
        ceiling = min(0.8, 0.1 * 2 ** (attempt - 1))
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, delays)
    assert {1, 2, 3} <= set(by_attempt)


@pytest.mark.slow
def test_sigterm_finishes_the_delivery_in_flight_releases_the_rest_and_exits(
    conn: psycopg.Connection[Row], factory: Factory, receiver: Receiver, workers: Any
) -> None:
    receiver.configure(delay=1.5)
    shop = factory.shop(fulfilment_url=receiver.url)
    add_rows(conn, shop, 3)
    worker = workers(batch="3", concurrency="1", timeout="5s", lease="30s")
    wait_until(lambda: len(receiver.requests()) == 1, "one delivery is in flight")
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0

    rows = outbox(conn)
    delivered = [r for r in rows if r["state"] == "delivered"]
    released = [r for r in rows if r["state"] == "pending"]
    assert len(delivered) == 1 and delivered[0]["key"] == receiver.keys()[0]
    assert len(released) == 2
    assert all(r["attempts"] == 0 and r["claim_token"] is None for r in released)
    assert len(receiver.requests()) == 1
    assert len(worker.events("outbox_released")) == 2
    assert worker.events("outbox_worker_stopped")


def test_once_delivers_what_is_due_and_exits(
    conn: psycopg.Connection[Row], factory: Factory, receiver: Receiver, workers: Any
) -> None:
    shop = factory.shop(fulfilment_url=receiver.url)
    keys = add_rows(conn, shop, 4)
    later = add_rows(conn, shop, 1)
    conn.execute(
        "UPDATE payhook.payment_outbox SET next_attempt_at = now() + interval '1 hour'"
        " WHERE tenant_id || ':' || event_id || ':' || action = %s",
        (later[0],),
    )
    assert workers("--once").wait() == 0
    assert sorted(receiver.keys()) == sorted(keys)
    assert count(conn, "delivered") == 4 and count(conn, "pending") == 1


@pytest.mark.slow
def test_idle_worker_wakes_on_the_commit_notification_not_the_poll(
    settings: Settings,
    conn: psycopg.Connection[Row],
    factory: Factory,
    receiver: Receiver,
    workers: Any,
) -> None:
    """With a 10-minute poll, only the consumer's NOTIFY can bring the delivery this soon."""
    shop = factory.shop(fulfilment_url=receiver.url)
    order_id = factory.order(shop)
    worker = workers(poll="10m")
    wait_until(lambda: listeners(conn) == 1, "the worker listens")
    time.sleep(0.3)  # let it finish its first look at the (empty) table and go idle

    runtime = Runtime(settings=settings, pool=create_pool(settings, "test", size=1))
    runtime.pool.open(wait=True)
    event = StandardEvent()
    assert handle(runtime, factory.standard_envelope(shop, event).to_json()).outcome == "applied"
    runtime.pool.close()

    wait_until(lambda: count(conn, "delivered") == 1, "the row is delivered", timeout=30)
    assert receiver.keys() == [f"{shop.tenant_id}:{event.event_id}:fulfil_order"]
    assert order_id in receiver.requests()[0]["body"]
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0


def test_bad_setting_stops_the_worker_at_start_naming_it(workers: Any, tmp_path: Path) -> None:
    worker = workers(lease="soon")
    assert worker.wait() == 2
    assert "PAYHOOK_OUTBOX_LEASE" in worker.errors.read_text()


@pytest.mark.slow
def test_worker_survives_its_database_connections_being_terminated(
    conn: psycopg.Connection[Row], factory: Factory, receiver: Receiver, workers: Any
) -> None:
    """Claims reconnect through the pool, the listener reconnects and wakes the worker again."""
    shop = factory.shop(fulfilment_url=receiver.url)
    worker = workers(poll="10m")
    wait_until(lambda: listeners(conn) == 1, "the worker listens")
    add_rows(conn, shop, 1)
    wait_until(lambda: count(conn, "delivered") == 1, "the first row is delivered")

    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'payhook-outbox-%%'"
    )
    wait_until(lambda: worker.events("outbox_listen_lost"), "the worker notices")
    wait_until(lambda: listeners(conn) == 1, "the worker listens again")
    keys = add_rows(conn, shop, 3)
    wait_until(lambda: count(conn, "delivered") == 4, "the new rows are delivered", timeout=30)
    assert set(keys) <= set(receiver.keys())
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
