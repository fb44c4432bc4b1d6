"""Alert signals from PostgreSQL and Redis: `payhook check` and the Prometheus export."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql
from redis import Redis
from rq.registry import FailedJobRegistry, ScheduledJobRegistry
from rq.utils import utcformat

from consumer.transaction import Applied, apply_event
from control.alerts import (
    SIGNALS,
    AlertCollector,
    AlertSettings,
    AlertsUnavailable,
    Signal,
    oldest_waiting,
    read_signals,
)
from payhook import counters, quarantine
from payhook.db import Row, connect
from payhook.endpoints import Endpoint
from payhook.gateways import get_gateway
from payhook.queue import events_queue
from payhook.settings import MAX_DURATION, Settings
from tests.conftest import test_settings
from tests.factories import Factory, Shop, StandardEvent
from tests.processes import process_env


def deliver(conn: psycopg.Connection[Row], shop: Shop, event: StandardEvent) -> Applied:
    body = event.body()
    parsed = get_gateway("standard").parse(event.headers(shop.secret, body), body)
    endpoint = Endpoint(shop.endpoint_id, shop.tenant_id, "standard", (shop.secret,))
    return apply_event(conn, endpoint, parsed, str(uuid.uuid4()))


def check(settings: Settings, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "control.cli", "check"],
        env=process_env(settings, **extra),
        capture_output=True,
        text=True,
        timeout=30,
    )


@contextmanager
def locked(settings: Settings, table: str, *, at_most: float = 5.0) -> Iterator[None]:
    """`table` locked, as a migration's ALTER TABLE or a VACUUM FULL locks it.

    The server ends the locking session after `at_most` seconds, so that a
    reader without a timeout of its own fails its test late instead of hanging it.
    """
    locker = psycopg.connect(str(settings.database_url), autocommit=True)
    locker.execute(
        "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
        [str(int(at_most * 1000))],
    )
    locker.execute("BEGIN")
    locker.execute(
        sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.Identifier("payhook", table))
    )
    try:
        yield
    finally:
        with suppress(psycopg.Error):
            locker.rollback()
        locker.close()


def values(conn: psycopg.Connection[Row], redis: Redis, settings: Settings) -> dict[str, int]:
    signals = read_signals(conn, redis, settings, AlertSettings.from_settings(settings))
    return {s.name: s.value for s in signals}


def test_check_exits_0_on_a_quiet_system_and_1_after_a_digest_conflict(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    factory.order(shop)
    event = StandardEvent()
    assert deliver(conn, shop, event).outcome == "applied"
    assert deliver(conn, shop, event).outcome == "duplicate"  # an honest redelivery

    quiet = check(settings)
    assert (quiet.returncode, quiet.stdout) == (0, ""), quiet.stderr

    tampered = StandardEvent(event_id=event.event_id, amount=1)
    assert deliver(conn, shop, tampered).outcome == "digest_conflict"
    loud = check(settings)
    assert loud.returncode == 1, loud.stderr
    assert loud.stdout.splitlines() == [
        "digest_conflicts 1 payload-digest conflicts in the last 24h"
    ]


def test_each_signal_counts_what_it_names(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    assert values(conn, redis_conn, settings) == dict.fromkeys(SIGNALS, 0)
    shop = factory.shop()
    order_id = factory.order(shop)
    assert deliver(conn, shop, StandardEvent()).outcome == "applied"
    assert deliver(conn, shop, StandardEvent(merchant_reference="x", gateway_order_id="y")).outcome
    second = factory.order(shop, "order-2", "pi_2")
    paid_second = StandardEvent(merchant_reference="order-2", gateway_order_id="pi_2")
    assert deliver(conn, shop, paid_second).outcome == "applied"
    # One outbox row written 10 minutes ago (past the 5 minute SLA), the other dead.
    conn.execute(
        "UPDATE payhook.payment_outbox SET created_at = now() - interval '10 minutes'"
        " WHERE order_id = %s",
        (order_id,),
    )
    conn.execute("UPDATE payhook.payment_outbox SET state = 'dead' WHERE order_id = %s", (second,))
    factory.order(shop, "order-3", "pi_3")
    underpaid = StandardEvent(merchant_reference="order-3", gateway_order_id="pi_3", amount=1)
    assert deliver(conn, shop, underpaid).outcome == "amount_mismatch"
    conn.execute(
        "INSERT INTO payhook.security_anomalies (tenant_id, endpoint_id, kind)"
        " VALUES (%s, %s, 'signature_invalid')",
        (shop.tenant_id, shop.endpoint_id),
    )
    counters.record(redis_conn, counters.SERIALIZATION_RETRIES, 20)
    queue = events_queue(redis_conn, settings)
    failed = queue.enqueue("consumer.jobs.apply_event", {"v": 1})
    queue.remove(failed)
    FailedJobRegistry(queue=queue).add(failed, ttl=600, exc_string="boom")
    # A job waiting since 10 minutes ago, at the head of the queue; one behind it.
    waiting = queue.enqueue("consumer.jobs.apply_event", {"v": 1})
    queue.enqueue("consumer.jobs.apply_event", {"v": 1})
    ten_minutes_ago = datetime.now(UTC) - timedelta(minutes=10)
    redis_conn.hset(waiting.key, "enqueued_at", utcformat(ten_minutes_ago))
    quarantine.move(redis_conn, settings.queue, b"\xff", "id: not a job id payhook writes")
    # A reconciliation run that found 2 events missing; one from before the window.
    for missing, started in ((2, "now()"), (5, "now() - interval '2 days'")):
        conn.execute(
            "INSERT INTO payhook.reconcile_runs"
            " (tenant_id, id, endpoint_id, window_start, window_end, missing, started_at)"
            f" VALUES (%s, gen_random_uuid(), %s, now(), now(), %s, {started})",
            (shop.tenant_id, shop.endpoint_id, missing),
        )

    got = values(conn, redis_conn, settings)
    assert 600 <= got.pop("queue_backlog") < 660
    assert got == {
        "digest_conflicts": 0,
        "rejected_jobs": 1,
        "unmapped_events": 1,
        "late_events": 0,
        "open_exceptions": 1,
        "serialization_retries": 20,
        "outbox_overdue": 1,
        "outbox_dead": 1,
        "dead_letter_jobs": 1,
        "quarantined_jobs": 1,
        "missed_events": 2,
    }
    signals = read_signals(conn, redis_conn, settings, AlertSettings.from_settings(settings))
    active = {s.name for s in signals if s.active}
    # 20 retries is the threshold, not above it.
    assert active == {
        "rejected_jobs",
        "unmapped_events",
        "open_exceptions",
        "queue_backlog",
        "outbox_overdue",
        "outbox_dead",
        "dead_letter_jobs",
        "quarantined_jobs",
        "missed_events",
    }
    # Within PAYHOOK_ALERT_BACKLOG, a waiting job is no alert.
    patient = replace(settings, extra={**settings.extra, "PAYHOOK_ALERT_BACKLOG": "15m"})
    relaxed = AlertSettings.from_settings(patient)
    signals = read_signals(conn, redis_conn, settings, relaxed)
    assert "queue_backlog" not in {s.name for s in signals if s.active}
    counters.record(redis_conn, counters.SERIALIZATION_RETRIES, 1)
    signals = read_signals(conn, redis_conn, settings, AlertSettings.from_settings(settings))
    assert "serialization_retries" in {s.name for s in signals if s.active}

    loud = check(settings)
    assert loud.returncode == 1
    assert [line.split()[0] for line in loud.stdout.splitlines()] == [
        "rejected_jobs",
        "unmapped_events",
        "open_exceptions",
        "queue_backlog",
        "serialization_retries",
        "outbox_overdue",
        "outbox_dead",
        "dead_letter_jobs",
        "quarantined_jobs",
        "missed_events",
    ]


def test_prometheus_export_carries_the_same_signals(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    shop = factory.shop()
    assert deliver(conn, shop, StandardEvent()).outcome == "unmapped_order"
    config = AlertSettings.from_settings(settings)

    def read() -> list[Signal]:
        with connect(settings, "test") as own:
            return read_signals(own, redis_conn, settings, config)

    registry = CollectorRegistry()
    registry.register(AlertCollector(read))
    samples = {
        (s.name, s.labels.get("alert")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples[("payhook_alerts_up", None)] == 1
    for name, value in values(conn, redis_conn, settings).items():
        assert samples[("payhook_alert_value", name)] == value
    assert samples[("payhook_alert_value", "unmapped_events")] == 1
    assert samples[("payhook_alert_threshold", "serialization_retries")] == 20

    def broken() -> list[Signal]:
        raise AlertsUnavailable("Redis: down")

    failing = CollectorRegistry()
    failing.register(AlertCollector(broken))
    text = generate_latest(failing).decode()
    assert "payhook_alerts_up 0.0" in text and "payhook_alert_value" not in text


def test_check_fails_loudly_when_redis_does_not_answer(settings: Settings) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    failed = check(settings, REDIS_URL=f"redis://127.0.0.1:{port}/0")
    assert failed.returncode == 2
    assert "Redis" in failed.stderr


def test_check_cannot_tell_rather_than_hang_behind_a_locked_table(settings: Settings) -> None:
    """A table the signals read is locked: `payhook check` exits 2 within
    `PAYHOOK_ALERT_TIMEOUT`, as when PostgreSQL is down, and says why."""
    for table in ("payment_outbox", "security_anomalies", "payment_exceptions"):
        with locked(settings, table):
            started = time.monotonic()
            blocked = check(settings, PAYHOOK_ALERT_TIMEOUT="200ms")
            took = time.monotonic() - started
        assert blocked.returncode == 2, (table, blocked.returncode, blocked.stderr)
        assert "PAYHOOK_ALERT_TIMEOUT" in blocked.stderr and "locked" in blocked.stderr
        assert took < 4, table
    assert check(settings, PAYHOOK_ALERT_TIMEOUT="200ms").returncode == 0


def test_a_timed_out_read_leaves_the_connection_as_it_was(
    conn: psycopg.Connection[Row], settings: Settings, redis_conn: Redis
) -> None:
    """The timeouts bound the read's own transaction, not the caller's session."""
    config = replace(AlertSettings.from_settings(settings), timeout=0.2)
    with locked(settings, "payment_outbox"):
        started = time.monotonic()
        with pytest.raises(AlertsUnavailable, match=r"within 0\.2s"):
            read_signals(conn, redis_conn, settings, config)
        assert time.monotonic() - started < 3
    assert conn.execute("SHOW statement_timeout").fetchone() == {"statement_timeout": "0"}
    assert conn.execute("SHOW lock_timeout").fetchone() == {"lock_timeout": "0"}
    assert len(read_signals(conn, redis_conn, settings, config)) == len(SIGNALS)


def test_the_longest_window_allowed_is_one_postgresql_can_read(
    conn: psycopg.Connection[Row], database: str, redis_conn: Redis
) -> None:
    longest = f"{int(MAX_DURATION // 86400)}d"
    settings = test_settings(database, PAYHOOK_ALERT_WINDOW=longest, PAYHOOK_OUTBOX_SLA=longest)
    config = AlertSettings.from_settings(settings)
    assert config.window == config.outbox_sla == MAX_DURATION
    assert len(read_signals(conn, redis_conn, settings, config)) == len(SIGNALS)


def test_an_event_refused_beyond_the_horizon_raises_the_late_events_alert(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    shop = factory.shop()
    factory.order(shop)
    ancient = StandardEvent(timestamp=int(time.time()) - 401 * 86400)
    assert deliver(conn, shop, ancient).outcome == "beyond_horizon"
    assert values(conn, redis_conn, settings)["late_events"] == 1
    loud = check(settings)
    assert loud.returncode == 1 and loud.stdout.split()[0] == "late_events"


def test_backlog_passes_over_head_ids_without_a_readable_job(
    conn: psycopg.Connection[Row], settings: Settings, redis_conn: Redis
) -> None:
    """Consumers down: the ids at the head may name jobs gone or unreadable; the
    age is that of the first job that can be read, not zero."""
    queue = events_queue(redis_conn, settings)
    gone = queue.enqueue("consumer.jobs.apply_event", {"v": 1})
    garbled = queue.enqueue("consumer.jobs.apply_event", {"v": 1})
    old = queue.enqueue("consumer.jobs.apply_event", {"v": 1})
    redis_conn.delete(gone.key)
    redis_conn.hset(garbled.key, "enqueued_at", b"\xff yesterday")
    redis_conn.hset(old.key, "enqueued_at", utcformat(datetime.now(UTC) - timedelta(minutes=10)))
    assert queue.get_job_ids()[:3] == [gone.id, garbled.id, old.id]
    assert 600 <= values(conn, redis_conn, settings)["queue_backlog"] < 660
    assert oldest_waiting(queue) >= 600
    queue.empty()
    assert oldest_waiting(queue) == 0


def test_a_retry_overdue_on_its_schedule_is_a_backlog(
    conn: psycopg.Connection[Row], settings: Settings, redis_conn: Redis
) -> None:
    """Jobs retried with backoff (the database was down) wait in RQ's
    scheduled registry; the consumers' schedulers move each onto the queue
    at its time. All consumers down, nothing moves them, the queue itself
    may be empty, and the backlog must still show."""
    queue = events_queue(redis_conn, settings)
    job = queue.enqueue("consumer.jobs.apply_event", {"v": 1})
    queue.remove(job.id)
    registry = ScheduledJobRegistry(queue=queue)
    registry.schedule(job, datetime.now(UTC) + timedelta(minutes=1))
    assert queue.count == 0
    assert oldest_waiting(queue) == 0, "not due yet"
    registry.schedule(job, datetime.now(UTC) - timedelta(minutes=10))
    assert 600 <= values(conn, redis_conn, settings)["queue_backlog"] < 660
