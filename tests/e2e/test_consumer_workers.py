"""Real RQ worker processes draining the events queue."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
from redis import Redis
from rq import Retry
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from rq.webhook import Webhook
from rq.worker import Worker

from payhook.queue import APPLY_EVENT, enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import Factory, StandardEvent
from tests.processes import process_env, start, stop, wait_until

FAST = {
    "PAYHOOK_JOB_TIMEOUT": "3",
    "PAYHOOK_JOB_GRACE": "2",
    "PAYHOOK_MAINTENANCE_INTERVAL": "1",
    "PAYHOOK_JOB_RETRY_INTERVALS": "0,1,1",
}


def fetch(redis_conn: Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)


def killed_by_fault(fault: str, env: dict[str, str], tmp_path: Path) -> None:
    """Run a consumer with the fault point `fault` until it SIGKILLs itself;
    then stop its scheduler child too, as when a container is killed (the
    first retry is immediate, so recovery does not wait for the scheduler's
    lock to expire)."""
    doomed = start(["consumer"], env | {"PAYHOOK_FAULTS": fault}, tmp_path / "doomed.log")
    assert doomed.wait(timeout=30) == -signal.SIGKILL
    stop(doomed)


def retried_by_a_survivor(
    redis_conn: Redis, job_id: str, env: dict[str, str], tmp_path: Path
) -> str:
    """Run a consumer until the abandoned job `job_id` is retried and
    finishes; the outcome of that run."""
    survivor = start(["consumer"], env, tmp_path / "survivor.log")
    try:
        wait_until(
            lambda: fetch(redis_conn, job_id).get_status() == JobStatus.FINISHED,
            timeout=45,
            what="the abandoned job to be retried and finish",
        )
    finally:
        stop(survivor)
    return str(cast(dict[str, Any], fetch(redis_conn, job_id).return_value())["outcome"])


@pytest.mark.slow
def test_twenty_jobs_of_one_event_drained_by_three_workers_apply_once(
    settings: Settings, redis_conn: Redis, factory: Factory, tmp_path: Path
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent()
    queue = events_queue(redis_conn, settings)
    jobs = []
    for _ in range(20):
        env = factory.standard_envelope(shop, event)
        jobs.append(enqueue_event(queue, env, settings).id)
    workers = [
        start(["consumer", "--burst"], process_env(settings), tmp_path / f"w{i}.log")
        for i in range(3)
    ]
    codes = [w.wait(timeout=60) for w in workers]
    assert codes == [0, 0, 0], [p.read_text()[-2000:] for p in tmp_path.glob("*.log")]
    outcomes = Counter(
        cast(dict[str, Any], fetch(redis_conn, j).return_value())["outcome"] for j in jobs
    )
    assert outcomes == {"applied": 1, "duplicate": 19}
    assert factory.count("payment_event_receipts") == 1
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert factory.count("payment_outbox", order_id=order_id) == 1
    busy = Counter(
        json.loads(line)["worker"]
        for p in tmp_path.glob("*.log")
        for line in p.read_text().splitlines()
        if '"consumer_started"' in line
    )
    assert len(busy) == 3


@pytest.mark.slow
def test_worker_killed_after_commit_is_retried_without_a_second_effect(
    settings: Settings, redis_conn: Redis, factory: Factory, tmp_path: Path
) -> None:
    """The job is SIGKILLed after its transaction committed, before RQ recorded it."""
    shop = factory.shop()
    order_id = factory.order(shop)
    queue = events_queue(redis_conn, Settings.from_env(process_env(settings, **FAST)))
    job_id = enqueue_event(
        queue,
        factory.standard_envelope(shop, StandardEvent()),
        Settings.from_env(process_env(settings, **FAST)),
    ).id
    env = process_env(settings, **FAST)
    killed_by_fault("consumer_kill_after_commit", env, tmp_path)
    assert factory.count("payment_event_receipts", outcome="applied") == 1
    assert fetch(redis_conn, job_id).get_status() == JobStatus.STARTED

    assert retried_by_a_survivor(redis_conn, job_id, env, tmp_path) == "duplicate"
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert factory.count("payment_outbox", order_id=order_id) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "execution_recorded"),
    [("consumer_kill_before_started", False), ("consumer_kill_between_start_writes", True)],
)
def test_worker_killed_before_rq_recorded_the_start_is_retried_without_a_second_effect(
    settings: Settings,
    redis_conn: Redis,
    factory: Factory,
    tmp_path: Path,
    fault: str,
    execution_recorded: bool,
) -> None:
    """The event commits while RQ records its job as started, in two writes
    (the execution, then the job's status); the worker is SIGKILLed before
    the first or between them. The job is still in the queue's intermediate
    list, which RQ retries a job from once a worker has seen it there, not
    started, for a minute; a recorded execution of a job never marked started
    RQ drops when it expires, without a retry, and then the list returns it."""
    shop = factory.shop()
    order_id = factory.order(shop)
    env = process_env(settings, **FAST)
    queue = events_queue(redis_conn, Settings.from_env(env))
    job_id = enqueue_event(
        queue, factory.standard_envelope(shop, StandardEvent()), Settings.from_env(env)
    ).id
    killed_by_fault(fault, env, tmp_path)
    assert factory.count("payment_event_receipts", outcome="applied") == 1
    assert fetch(redis_conn, job_id).get_status() == JobStatus.QUEUED
    assert (job_id in queue.started_job_registry) == execution_recorded
    intermediate = queue.intermediate_queue
    assert intermediate.get_job_ids() == [job_id]
    # The test dates that first sighting back rather than wait the minute.
    redis_conn.set(intermediate.get_first_seen_key(job_id), time.time() - 120)

    assert retried_by_a_survivor(redis_conn, job_id, env, tmp_path) == "duplicate"
    assert intermediate.get_job_ids() == []
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert factory.count("payment_outbox", order_id=order_id) == 1


def test_a_finished_job_and_its_result_leave_redis_after_the_result_ttl(
    settings: Settings, redis_conn: Redis, factory: Factory, tmp_path: Path
) -> None:
    """Finished jobs hold raw bodies; they stay PAYHOOK_RESULT_TTL, not RQ's default."""
    short = dataclasses.replace(settings, result_ttl=40.0)
    shop = factory.shop()
    factory.order(shop)
    job = enqueue_event(
        events_queue(redis_conn, short), factory.standard_envelope(shop, StandardEvent()), short
    )
    worker = start(["consumer", "--burst"], process_env(settings), tmp_path / "w.log")
    assert worker.wait(timeout=60) == 0
    assert cast(dict[str, Any], fetch(redis_conn, job.id).return_value())["outcome"] == "applied"
    keys = [job.key, *redis_conn.keys(f"rq:results:{job.id}")]
    assert len(keys) == 2
    for key in keys:
        assert 0 < redis_conn.ttl(key) <= 40, key


def test_job_naming_a_foreign_function_is_refused(
    settings: Settings, redis_conn: Redis, tmp_path: Path
) -> None:
    marker = tmp_path / f"pwned-{uuid.uuid4().hex}"
    queue = events_queue(redis_conn, settings)
    job = queue.enqueue("os.system", f"touch {marker}", retry=None)
    worker = start(["consumer", "--burst"], process_env(settings), tmp_path / "w.log")
    assert worker.wait(timeout=60) == 0
    assert not marker.exists()
    assert job.id in FailedJobRegistry(queue=queue).get_job_ids()
    result = fetch(redis_conn, job.id).latest_result()
    assert result is not None
    assert "ForbiddenJob" in (result.exc_string or "")


def test_a_job_carrying_webhooks_or_an_odd_function_name_is_refused_and_sends_nothing(
    settings: Settings, redis_conn: Redis, factory: Factory, tmp_path: Path
) -> None:
    """RQ sends a job's webhooks (any URL, any headers) when it finishes or
    fails, outside the job's timeout: whoever writes to Redis could make a
    consumer call anything, or hang it on a peer that never answers. payhook
    never writes webhooks, so such a job fails at once, unretried, and nothing
    is sent. A function name that is not a string is refused at once too."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    shop = factory.shop()
    signed = factory.standard_envelope(shop, StandardEvent(type="customer.created")).to_json()
    queue = events_queue(redis_conn, settings)
    hooks = [
        Webhook(f"http://127.0.0.1:{port}/{status}", status, timeout=10**6)
        for status in ("finished", "failed")
    ]
    hooked = queue.enqueue(APPLY_EVENT, signed, webhooks=hooks, retry=Retry(max=3))
    odd = queue.enqueue(APPLY_EVENT, signed, retry=Retry(max=3))
    data = json.loads(zlib.decompress(cast(bytes, redis_conn.hget(odd.key, "data"))))
    data[0] = [APPLY_EVENT]
    redis_conn.hset(odd.key, "data", zlib.compress(json.dumps(data).encode()))

    worker = start(["consumer", "--burst"], process_env(settings, **FAST), tmp_path / "w.log")
    try:
        assert worker.wait(timeout=60) == 0, (tmp_path / "w.log").read_text()[-2000:]
    finally:
        stop(worker)
    with pytest.raises(TimeoutError):
        listener.accept()  # the consumer never connected
    listener.close()
    failed = FailedJobRegistry(queue=queue).get_job_ids()
    for job, reason in ((hooked, "carries webhooks"), (odd, "names ['")):
        assert job.id in failed
        refused = fetch(redis_conn, job.id)
        assert refused.retries_left == 0
        result = refused.latest_result()
        assert result is not None
        assert reason in (result.exc_string or ""), reason
    assert factory.count("payment_event_receipts") == 0


@pytest.mark.parametrize("kind", ["signature_invalid", "unknown_endpoint", "malformed_job"])
def test_job_the_consumer_refuses_stays_in_the_dead_letter_queue_unretried(
    kind: str, settings: Settings, redis_conn: Redis, factory: Factory, tmp_path: Path
) -> None:
    """A job the consumer cannot verify or read applies nothing; it may be an
    acknowledged event, so it is kept, raw, in the dead-letter queue, not
    finished and left to expire, and not retried into more anomalies."""
    shop = factory.shop()
    order_id = factory.order(shop)
    signed = factory.standard_envelope(shop, StandardEvent())
    queue = events_queue(redis_conn, settings)
    if kind == "signature_invalid":
        data = dataclasses.replace(signed, body=signed.body.replace(b"1999", b"1")).to_json()
    elif kind == "unknown_endpoint":
        data = dataclasses.replace(signed, endpoint_id=str(uuid.uuid4())).to_json()
    else:
        data = {"v": 1, "endpoint_id": shop.endpoint_id}
    assert data != signed.to_json()
    job = queue.enqueue(APPLY_EVENT, data, retry=Retry(max=3, interval=[0, 1, 1]))
    worker = start(["consumer", "--burst"], process_env(settings, **FAST), tmp_path / "w.log")
    assert worker.wait(timeout=60) == 0, (tmp_path / "w.log").read_text()[-2000:]
    assert job.id in FailedJobRegistry(queue=queue).get_job_ids()
    failed = fetch(redis_conn, job.id)
    assert failed.retries_left == 0
    result = failed.latest_result()
    assert result is not None
    assert f"RefusedJob: {kind}" in (result.exc_string or "")
    assert failed.args[0] == data, "the raw envelope is kept"
    assert factory.count("security_anomalies", kind=kind) == 1
    assert factory.count("security_anomalies") == 1
    assert factory.count("payment_event_receipts") == 0
    assert factory.order_state(shop, order_id) == "pending"


def test_registry_cleaning_lock_of_a_killed_worker_expires_within_a_minute(
    settings: Settings, redis_conn: Redis
) -> None:
    """RQ's own lock lasts 899 s: a worker killed while cleaning would stop abandoned
    jobs from being recovered for 15 minutes."""
    from consumer.worker import PayhookQueue

    queue = PayhookQueue(settings.queue, connection=redis_conn, serializer=JSONSerializer)
    assert queue.acquire_maintenance_lock()
    assert not queue.acquire_maintenance_lock(), "one cleaner at a time"
    assert 0 < redis_conn.ttl(queue.registry_cleaning_key) <= 60


BROKEN_LOOP = """
import sys
from consumer.worker import PayhookWorker
from control.cli import main

def broken(self, timeout, max_idle_time=None):
    raise RuntimeError("something RQ did not expect")

PayhookWorker.dequeue_job_and_maintain_ttl = broken
sys.exit(main(["consumer"]))
"""


def test_a_consumer_exits_0_when_told_to_stop_and_1_when_its_loop_broke(
    settings: Settings, redis_conn: Redis, tmp_path: Path
) -> None:
    """RQ ends its loop quietly on a Redis timeout or an error it did not
    expect; reporting success then would keep a supervisor that restarts on
    failure from bringing the consumer back."""
    log = tmp_path / "told.log"
    told = start(["consumer"], process_env(settings), log)
    try:
        wait_until(
            lambda: any(w.name in log.read_text() for w in Worker.all(connection=redis_conn)),
            30,
            "the consumer to register",
        )
        time.sleep(1)  # RQ installs its signal handlers once registered
    finally:
        code = stop(told)
    assert code == 0, log.read_text()[-2000:]

    broken = subprocess.Popen(
        [sys.executable, "-c", BROKEN_LOOP],
        env=process_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = broken.communicate(timeout=60)
    finally:
        stop(broken)
    assert broken.returncode == 1, output.decode()[-2000:]
    assert b"consumer_stopped_unexpectedly" in output


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault",
    [
        "consumer_kill_after_take",
        "consumer_kill_before_started",
        "consumer_kill_between_start_writes",
        "consumer_kill_after_commit",
    ],
)
def test_a_worker_killed_inside_a_batch_loses_nothing_and_applies_nothing_twice(
    settings: Settings, redis_conn: Redis, factory: Factory, tmp_path: Path, fault: str
) -> None:
    """Five jobs taken as one batch; the worker SIGKILLed once it has taken
    them, once their transaction committed (before RQ recorded anything of
    their start, between its two writes, or after both). RQ's recovery
    returns every job; each event has one receipt, one transition and one
    outbox row, applied by the batch or by the retry, never both."""
    shop = factory.shop()
    env = process_env(settings, **FAST)
    queue = events_queue(redis_conn, Settings.from_env(env))
    orders, jobs = [], []
    for i in range(5):
        orders.append(factory.order(shop, f"order-{i}", f"pi_{i}"))
        event = StandardEvent(gateway_order_id=f"pi_{i}", merchant_reference=f"order-{i}")
        envelope = factory.standard_envelope(shop, event)
        jobs.append(enqueue_event(queue, envelope, Settings.from_env(env)).id)
    killed_by_fault(fault, env, tmp_path)
    committed = fault != "consumer_kill_after_take"
    assert factory.count("payment_event_receipts", outcome="applied") == (5 if committed else 0)
    intermediate = queue.intermediate_queue
    if fault != "consumer_kill_after_commit":
        assert sorted(intermediate.get_job_ids()) == sorted(jobs)
        for job_id in jobs:  # dated back rather than wait RQ's minute
            redis_conn.set(intermediate.get_first_seen_key(job_id), time.time() - 120)

    survivor = start(["consumer"], env, tmp_path / "survivor.log")
    try:
        wait_until(
            lambda: all(fetch(redis_conn, j).get_status() == JobStatus.FINISHED for j in jobs),
            timeout=45,
            what="every job of the batch to be retried and finish",
        )
    finally:
        stop(survivor)
    outcomes = [cast(dict[str, Any], fetch(redis_conn, j).return_value())["outcome"] for j in jobs]
    assert outcomes == ["duplicate" if committed else "applied"] * 5
    assert intermediate.get_job_ids() == []
    for order_id in orders:
        assert factory.count("payment_order_transitions", order_id=order_id) == 1
        assert factory.count("payment_outbox", order_id=order_id) == 1
    assert factory.count("payment_event_receipts") == 5
