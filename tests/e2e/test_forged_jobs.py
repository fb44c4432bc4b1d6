"""Nothing written into a job hash stops a real consumer process."""

from __future__ import annotations

import os
import uuid
import zlib
from pathlib import Path
from typing import cast

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from redis import Redis
from redis.typing import EncodableT, FieldT
from rq.job import JobStatus

from payhook import quarantine
from payhook.jobhash import data_bound
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import Factory, StandardEvent
from tests.processes import process_env, start, stop, wait_until

#: Every field RQ reads from a job hash.
FIELDS = (
    "data",
    "created_at",
    "origin",
    "worker_name",
    "description",
    "enqueued_at",
    "started_at",
    "ended_at",
    "last_heartbeat",
    "group_id",
    "result",
    "timeout",
    "result_ttl",
    "failure_ttl",
    "status",
    "success_callback_name",
    "success_callback_timeout",
    "failure_callback_name",
    "failure_callback_timeout",
    "stopped_callback_name",
    "stopped_callback_timeout",
    "webhooks",
    "dependency_ids",
    "dependency_id",
    "allow_dependency_failures",
    "enqueue_at_front",
    "ttl",
    "meta",
    "number_of_retries",
    "retries_left",
    "retry_intervals",
    "enqueue_at_front_on_retry",
    "repeats_left",
)
#: Values that are almost right, beside random bytes.
NEAR_MISSES = st.sampled_from(
    [
        b"",
        b"0",
        b"-1",
        b"-2",
        b"1e3",
        b"99999999999999999999999",
        b"queued",
        b"started",
        b"2024-01-01T00:00:00.000000Z",
        b"9999-12-31T23:59:59.999999Z",
        b"[]",
        b"[1, 2]",
        b"[-1]",
        b"[1e308]",
        b"{}",
        b"null",
        b"\xff\xfe",
        b"consumer.jobs.apply_event",
        b"os.system",
        zlib.compress(b"\0" * (data_bound(Settings.max_body) + 1), 9),
        zlib.compress(b'["consumer.jobs.apply_event", null, [1], {}]'),
    ]
)
FORGERIES = st.dictionaries(
    st.sampled_from(FIELDS),
    st.one_of(st.binary(max_size=24), NEAR_MISSES),
    min_size=1,
    max_size=4,
)
#: Ids placed on the queue: payhook's own form, or anything.
IDS = st.one_of(
    st.builds(lambda: str(uuid.uuid4()).encode()),
    st.binary(min_size=1, max_size=40),
)


@pytest.mark.slow
def test_a_worker_drains_valid_jobs_behind_any_forged_job_hash(
    settings: Settings, redis_conn: Redis, factory: Factory, tmp_path: Path
) -> None:
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    env = process_env(settings, PAYHOOK_MAINTENANCE_INTERVAL="1")
    worker = start(["consumer"], env, tmp_path / "consumer.log")
    forged_ids: list[bytes] = []

    def valid_job_applied() -> str:
        envelope = factory.standard_envelope(shop, StandardEvent(type="payment.noted"))
        job = enqueue_event(queue, envelope, settings)
        wait_until(
            lambda: job.get_status(refresh=True) == JobStatus.FINISHED or worker.poll() is not None,
            timeout=30,
            what="the valid job behind the forged one to finish",
        )
        return envelope.delivery_id

    @given(forgery=FORGERIES, raw_id=IDS)
    @hypothesis_settings(
        max_examples=int(os.environ.get("PAYHOOK_TEST_FORGERIES", "150")),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    def forged_then_valid(forgery: dict[str, bytes], raw_id: bytes) -> None:
        template = factory.standard_envelope(shop, StandardEvent(type="payment.noted"))
        job = enqueue_event(queue, template, settings)
        redis_conn.lrem(queue.key, 0, job.id)
        fields = cast(dict[FieldT, EncodableT], redis_conn.hgetall(job.key))
        redis_conn.delete(job.key)
        redis_conn.delete(b"rq:job:" + raw_id)
        redis_conn.hset(b"rq:job:" + raw_id, mapping=fields | forgery)
        redis_conn.rpush(queue.key, raw_id)
        forged_ids.append(raw_id)
        valid_job_applied()
        assert worker.poll() is None, (tmp_path / "consumer.log").read_text()[-3000:]

    try:
        forged_then_valid()
        assert worker.poll() is None
        # Nothing forged is left where a worker would read it again. An id
        # whose hash expired (a forged ttl) is dropped by RQ's maintenance.
        wait_until(
            lambda: redis_conn.llen(queue.intermediate_queue_key) == 0,
            timeout=30,
            what="the intermediate list to empty",
        )
        assert redis_conn.llen(queue.key) == 0
        assert worker.poll() is None
    finally:
        stop(worker)
    quarantined = set(quarantine.all_ids(redis_conn, settings.queue))
    assert quarantined <= set(forged_ids)
