"""A job RQ cannot read is quarantined, wherever the worker finds it, and
the worker goes on with the jobs behind it."""

from __future__ import annotations

import dataclasses
import json
import uuid
import zlib
from collections.abc import Callable

import pytest
from redis import Redis
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from consumer.handler import Runtime
from consumer.main import build_worker
from payhook import quarantine
from payhook.jobhash import data_bound
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import Factory, Shop, StandardEvent
from tests.processes import run_cli


def enqueue(settings: Settings, redis_conn: Redis, factory: Factory, shop: Shop) -> Job:
    """An event job of a type payhook records and ignores: one receipt, no order."""
    envelope = factory.standard_envelope(shop, StandardEvent(type="payment.noted"))
    return enqueue_event(events_queue(redis_conn, settings), envelope, settings)


def receipts(factory: Factory) -> int:
    return factory.count("payment_event_receipts")


BOMB = zlib.compress(b"\0" * (data_bound(Settings.max_body) + 1), 9)

FORGED_FIELDS = {
    "status": b"exploded",
    "created_at": b"yesterday",
    "enqueued_at": b"2024-13-45T99:00:00.000000Z",
    "last_heartbeat": b"\xff",
    "timeout": b"ten",
    "ttl": b"1e9",
    "result_ttl": b"99999999999999999999",
    "failure_ttl": b"-7",
    "retries_left": b"many",
    "retry_intervals": b"[1,",
    "dependency_ids": b"{not json",
    "worker_name": b"\xc3\x28",
    "origin": b"\xff\xfe",
    "success_callback_timeout": b"soon",
    "enqueue_at_front": b"yes",
    "data": BOMB,
}


@pytest.mark.parametrize(("field", "value"), FORGED_FIELDS.items(), ids=list(FORGED_FIELDS))
def test_a_job_with_an_unreadable_field_is_quarantined_and_the_next_is_applied(
    settings: Settings,
    redis_conn: Redis,
    factory: Factory,
    runtime: Runtime,
    field: str,
    value: bytes,
) -> None:
    shop = factory.shop()
    forged = enqueue(settings, redis_conn, factory, shop)
    redis_conn.hset(forged.key, field, value)
    valid = enqueue(settings, redis_conn, factory, shop)

    worker = build_worker(settings, runtime)
    worker.work(burst=True, logging_level="ERROR")

    assert Job.fetch(valid.id, connection=redis_conn, serializer=JSONSerializer).get_status() == (
        JobStatus.FINISHED
    )
    assert receipts(factory) == 1  # the valid event's; nothing of the forged one
    [entry] = quarantine.list_jobs(redis_conn, settings.queue)
    assert entry.job_id == forged.id.encode()
    assert entry.reason.startswith(f"{field}:")
    assert entry.found_in == worker.queues[0].intermediate_queue_key
    assert redis_conn.llen(worker.queues[0].intermediate_queue_key) == 0
    assert not redis_conn.exists(forged.key)  # renamed out of RQ's key space
    assert redis_conn.exists(quarantine.job_key(settings.queue, forged.id.encode()))


@pytest.mark.parametrize(
    "raw_id",
    [b"\xff\xfe-not-utf8", b"abc:def", str(uuid.uuid4()).upper().encode(), b"x" * 300],
    ids=["not-utf8", "composite", "upper-case", "long"],
)
def test_an_id_payhook_never_writes_is_quarantined(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime, raw_id: bytes
) -> None:
    shop = factory.shop()
    template = enqueue(settings, redis_conn, factory, shop)
    redis_conn.delete(template.key)
    redis_conn.lrem(f"rq:queue:{settings.queue}", 0, template.id)
    queue_key = f"rq:queue:{settings.queue}"
    redis_conn.rpush(queue_key, raw_id)
    redis_conn.hset(b"rq:job:" + raw_id, mapping={"data": b"[]", "origin": settings.queue})
    valid = enqueue(settings, redis_conn, factory, shop)

    build_worker(settings, runtime).work(burst=True, logging_level="ERROR")

    assert valid.get_status(refresh=True) == JobStatus.FINISHED
    [entry] = quarantine.list_jobs(redis_conn, settings.queue)
    assert entry.job_id == raw_id
    assert entry.reason.startswith("id:")


def key_of_another_type(redis_conn: Redis, job: Job) -> None:
    redis_conn.delete(job.key)
    redis_conn.set(job.key, b"not a hash")


def no_data(redis_conn: Redis, job: Job) -> None:
    redis_conn.hdel(job.key, "data")


def another_queue(redis_conn: Redis, job: Job) -> None:
    redis_conn.hset(job.key, "origin", "elsewhere")


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (key_of_another_type, "RQ could not read it (ResponseError)"),
        # RQ passes over a hash without data as if it were gone.
        (no_data, "data: missing"),
        (another_queue, "origin: not this queue"),
    ],
    ids=["another-type", "no-data", "another-queue"],
)
def test_a_job_hash_rq_would_misread_is_quarantined_and_the_next_is_applied(
    settings: Settings,
    redis_conn: Redis,
    factory: Factory,
    runtime: Runtime,
    forge: Callable[[Redis, Job], None],
    reason: str,
) -> None:
    shop = factory.shop()
    forged = enqueue(settings, redis_conn, factory, shop)
    forge(redis_conn, forged)
    valid = enqueue(settings, redis_conn, factory, shop)

    build_worker(settings, runtime).work(burst=True, logging_level="ERROR")

    assert valid.get_status(refresh=True) == JobStatus.FINISHED
    assert receipts(factory) == 1  # the valid event's; nothing of the forged one
    [entry] = quarantine.list_jobs(redis_conn, settings.queue)
    assert entry.reason == reason


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("success_callback_name", "os.system"),
        ("failure_callback_name", "os.system"),
        ("stopped_callback_name", "os.system"),
        ("dependency_ids", '["00000000-0000-0000-0000-000000000000"]'),
        ("group_id", "g1"),
        ("ttl", "1"),
    ],
)
def test_a_job_naming_a_callback_or_dependencies_is_refused_before_it_is_applied(
    settings: Settings,
    redis_conn: Redis,
    factory: Factory,
    runtime: Runtime,
    field: str,
    value: str,
) -> None:
    shop = factory.shop()
    forged = enqueue(settings, redis_conn, factory, shop)
    redis_conn.hset(forged.key, field, value)

    build_worker(settings, runtime).work(burst=True, logging_level="ERROR")

    assert receipts(factory) == 0
    assert forged.id in FailedJobRegistry(settings.queue, connection=redis_conn)
    assert quarantine.count(redis_conn, settings.queue) == 0


def test_maintenance_quarantines_what_it_would_otherwise_fail_on(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    """Unreadable jobs left in the intermediate list (a worker killed after
    the move), among the abandoned jobs and among the due retries."""
    shop = factory.shop()
    worker = build_worker(settings, runtime)
    queue = worker.queues[0]
    stranded, abandoned, retried = (enqueue(settings, redis_conn, factory, shop) for _ in range(3))
    for job in (stranded, abandoned, retried):
        redis_conn.lrem(queue.key, 0, job.id)
        redis_conn.hset(job.key, "status", "exploded")
    redis_conn.rpush(queue.intermediate_queue_key, stranded.id, b"\xff")
    redis_conn.zadd(queue.started_job_registry.key, {f"{abandoned.id}:exec-1": 1})
    redis_conn.zadd(queue.scheduled_job_registry.key, {retried.id: 1})
    valid = enqueue(settings, redis_conn, factory, shop)

    worker.work(burst=True, logging_level="ERROR")

    assert valid.get_status(refresh=True) == JobStatus.FINISHED
    found = {
        entry.job_id: entry.found_in for entry in quarantine.list_jobs(redis_conn, settings.queue)
    }
    assert found == {
        stranded.id.encode(): queue.intermediate_queue_key,
        b"\xff": queue.intermediate_queue_key,
        abandoned.id.encode(): queue.started_job_registry.key,
        retried.id.encode(): queue.scheduled_job_registry.key,
    }
    assert redis_conn.llen(queue.intermediate_queue_key) == 0
    assert redis_conn.zcard(queue.started_job_registry.key) == 0
    assert redis_conn.zcard(queue.scheduled_job_registry.key) == 0


def test_show_describes_a_job_without_its_data_and_purge_deletes_it(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    shop = factory.shop()
    forged = enqueue(settings, redis_conn, factory, shop)
    redis_conn.hset(forged.key, "status", "exploded")
    build_worker(settings, runtime).work(burst=True, logging_level="ERROR")

    shown = quarantine.show(redis_conn, settings.queue, forged.id.encode())
    assert shown is not None
    entry, fields = shown
    assert entry.reason == "status: not a status RQ knows"
    assert fields["status"] == "'exploded'"
    assert fields["data"].endswith("bytes)")

    assert quarantine.purge(redis_conn, settings.queue, [forged.id.encode()]) == 1
    assert quarantine.count(redis_conn, settings.queue) == 0
    assert not redis_conn.exists(quarantine.job_key(settings.queue, forged.id.encode()))
    assert quarantine.show(redis_conn, settings.queue, forged.id.encode()) is None


def test_the_quarantine_command_lists_shows_and_purges(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    shop = factory.shop()
    forged = enqueue(settings, redis_conn, factory, shop)
    redis_conn.hset(forged.key, "ttl", "forever")
    quarantine.move(redis_conn, settings.queue, b"odd\xff", "id: not a job id payhook writes")
    build_worker(settings, runtime).work(burst=True, logging_level="ERROR")

    listed = run_cli(settings, "quarantine", "list")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["job_id"], r["reason"]) for r in rows] == [
        (forged.id, "ttl: not a whole number from -1 to 3153600000"),
        ("odd\\xff", "id: not a job id payhook writes"),
    ]
    shown = run_cli(settings, "quarantine", "show", "odd\\xff", "nope")
    assert shown.returncode == 1
    assert [json.loads(line).get("error") for line in shown.stdout.splitlines()] == [
        "not quarantined",
        None,
    ]
    assert run_cli(settings, "quarantine", "purge").returncode != 0  # neither ids nor --all
    purged = run_cli(settings, "quarantine", "purge", "odd\\xff")
    assert json.loads(purged.stdout) == {"purged": 1}
    purged = run_cli(settings, "quarantine", "purge", "--all")
    assert json.loads(purged.stdout) == {"purged": 1}
    assert quarantine.count(redis_conn, settings.queue) == 0


def test_the_data_bound_follows_the_consumers_max_body(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    """Data within the default bound but past the consumer's own is quarantined."""
    small = dataclasses.replace(settings, max_body=1024)
    shop = factory.shop()
    forged = enqueue(small, redis_conn, factory, shop)
    padding = b"\0" * (data_bound(1024) + 1)
    redis_conn.hset(forged.key, "data", zlib.compress(padding))
    assert len(padding) < data_bound(Settings.max_body)

    build_worker(small, runtime).work(burst=True, logging_level="ERROR")

    [entry] = quarantine.list_jobs(redis_conn, small.queue)
    assert entry.reason == f"data: expands past {data_bound(1024)} bytes"
