"""PayhookWorker begins applying a batch's events while it records their jobs as started."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Any

import psycopg
import pytest
from redis import Redis
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from consumer import applier as applier_module
from consumer import batch as batch_module
from consumer import handler as handler_module
from consumer import jobs
from consumer.applier import Applier
from consumer.handler import Runtime
from consumer.main import build_worker
from consumer.worker import PayhookWorker
from payhook.errors import PayhookError
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import Factory, StandardEvent
from tests.locks import released_after
from tests.processes import wait_until


def built_as(
    cls: type[PayhookWorker], settings: Settings, runtime: Runtime | None, **extra: Any
) -> Any:
    """A worker of class `cls`, otherwise as `payhook consumer` builds its own."""
    built = build_worker(settings, runtime)
    worker = cls(
        [settings.queue],
        connection=built.connection,
        serializer=JSONSerializer,
        job_class=built.job_class,
        **extra,
    )
    worker.applier = built.applier
    return worker


def test_the_event_commits_while_rq_records_its_job_as_started(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    queue = events_queue(redis_conn, settings)
    job = enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings)
    applied_before_started = []
    record = batch_module.record_started

    def watched(worker: PayhookWorker, jobs: list[Job], *args: Any, **kwargs: Any) -> Any:
        try:
            wait_until(
                lambda: factory.count("payment_event_receipts", outcome="applied") == 1,
                timeout=10,
                what="the event to commit before RQ records its job as started",
            )
        except AssertionError:
            applied_before_started.append(False)
        else:
            applied_before_started.append(True)
        assert [j.get_status(refresh=True) for j in jobs] == [JobStatus.QUEUED]
        assert job.id not in StartedJobRegistry(job.origin, connection=redis_conn)
        return record(worker, jobs, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_module, "record_started", watched)
        build_worker(settings, runtime).work(burst=True, logging_level="ERROR")

    assert applied_before_started == [True]
    done = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert done.get_status() == JobStatus.FINISHED
    assert done.return_value() == {"outcome": "applied", "order_id": order_id, "retries": 0}
    assert factory.count("payment_order_transitions", order_id=order_id) == 1
    assert factory.count("payment_outbox", order_id=order_id) == 1


def test_the_event_is_applied_on_the_applier_thread(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    shop = factory.shop()
    factory.order(shop)
    queue = events_queue(redis_conn, settings)
    enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings)
    threads = []
    handle_many = handler_module.handle_many

    def spy(runtime: Runtime, envelopes: Any) -> Any:
        threads.append(threading.current_thread().name)
        return handle_many(runtime, envelopes)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(applier_module, "handle_many", spy)
        build_worker(settings, runtime).work(burst=True, logging_level="ERROR")
    assert len(threads) == 1 and threads[0].startswith("payhook-applier")


def test_a_job_rq_runs_itself_is_applied_on_its_own_thread(
    settings: Settings, factory: Factory, runtime: Runtime
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    envelope = factory.standard_envelope(shop, StandardEvent())
    applier = Applier(runtime)
    try:
        assert applier.finish(envelope.to_json())["outcome"] == "applied"
    finally:
        applier.close()
    assert factory.order_state(shop, order_id) == "paid"


def test_the_job_function_run_outside_a_consumer_refuses() -> None:
    with pytest.raises(PayhookError, match="only in a payhook consumer"):
        jobs.apply_event({})


def test_a_batch_that_cannot_be_begun_is_applied_by_its_job_functions(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    """Beginning runs in RQ's loop, outside the job: a failure there must not
    stop the worker, and each job still applies its event, once."""
    shop = factory.shop()
    order_id = factory.order(shop)
    queue = events_queue(redis_conn, settings)
    job = enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings)

    def broken(self: Applier, envelopes: Any) -> None:
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Applier, "begin", broken)
        build_worker(settings, runtime).work(burst=True, logging_level="ERROR")

    done = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert done.return_value() == {"outcome": "applied", "order_id": order_id, "retries": 0}
    assert factory.count("payment_outbox", order_id=order_id) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("data", b"\x00 not a job"),
        ("data", b'["consumer.jobs.apply_event", null, 5, {}]'),
        ("data", b'["consumer.jobs.apply_event", null, [{}], {"envelope": {}}]'),
        ("data", b'["consumer.jobs.apply_event", null, [{}, {}], {}]'),
        ("timeout", b"100000000000000000"),
        ("timeout", b"-1"),
    ],
    ids=[
        "unreadable",
        "arguments-not-a-list",
        "keyword-arguments",
        "two-arguments",
        "timeout-redis-cannot-expire",
        "no-timeout",
    ],
)
def test_a_job_unreadable_or_of_another_shape_fails_and_the_worker_goes_on(
    settings: Settings,
    redis_conn: Redis,
    factory: Factory,
    runtime: Runtime,
    field: str,
    value: bytes,
) -> None:
    """Whoever can write to Redis must not stop a consumer with a job it
    cannot read, or whose arguments payhook never writes: the job fails into
    the dead-letter queue at once, and the next job applies."""
    shop = factory.shop()
    order_id = factory.order(shop)
    queue = events_queue(redis_conn, settings)
    other = StandardEvent(event_id="evt_unreadable")
    unreadable = enqueue_event(queue, factory.standard_envelope(shop, other), settings)
    redis_conn.hset(unreadable.key, field, value)
    job = enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings)

    worker = build_worker(settings, runtime)
    worker.work(burst=True, logging_level="ERROR")

    assert not worker.stop_requested_by_signal
    assert unreadable.id in queue.failed_job_registry.get_job_ids()
    done = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert done.return_value() == {"outcome": "applied", "order_id": order_id, "retries": 0}


def test_a_worker_with_no_runtime_fails_the_job_and_goes_on(
    settings: Settings, redis_conn: Redis, factory: Factory
) -> None:
    """Nothing is begun, and each job function fails its job (retried once
    here, then dead-lettered) without stopping the worker."""
    once = dataclasses.replace(settings, job_retry_intervals=(0,))
    shop = factory.shop()
    factory.order(shop)
    queue = events_queue(redis_conn, once)
    first = enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), once)
    second = enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), once)

    build_worker(once).work(burst=True, logging_level="ERROR")

    assert set(queue.failed_job_registry.get_job_ids()) == {first.id, second.id}
    assert factory.count("payment_event_receipts") == 0


class StoppedWhileBeginning(PayhookWorker):
    def execute_batch(self, jobs: list[Job], queue: Any) -> None:
        assert self.applier is not None
        begin = self.applier.begin

        def begin_then_stop(envelopes: Any) -> Any:
            begun = begin(envelopes)
            os.kill(os.getpid(), signal.SIGTERM)
            return begun

        self.applier.begin = begin_then_stop  # type: ignore[method-assign]
        super().execute_batch(jobs, queue)


def test_a_stop_asked_for_while_an_event_is_begun_waits_for_its_job(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    """SIGTERM as the event is begun, before RQ recorded anything of the job:
    the job finishes, then the worker stops, leaving the next job queued."""
    shop = factory.shop()
    order_id = factory.order(shop)
    queue = events_queue(redis_conn, settings)
    job = enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings)
    waiting = enqueue_event(
        queue, factory.standard_envelope(shop, StandardEvent(event_id="evt_next")), settings
    )
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker = built_as(StoppedWhileBeginning, settings, runtime)
        worker.batch_size = 1  # one job in hand
        worker.work(burst=True, logging_level="ERROR")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    assert worker.stop_requested_by_signal
    done = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert done.return_value() == {"outcome": "applied", "order_id": order_id, "retries": 0}
    assert queue.get_job_ids() == [waiting.id]
    assert queue.intermediate_queue.get_job_ids() == []


@pytest.mark.parametrize("jobs", [1, 3], ids=["alone", "in-a-batch"])
def test_a_job_timeout_while_the_applier_waits_on_a_lock_cancels_its_statement(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime, jobs: int
) -> None:
    """RQ's timeout interrupts the batch, on the main thread, while the
    applier thread waits on a row lock: the statement is cancelled then, and
    leaves no transaction behind, as when the job applies its event itself.
    A batch cancelled so is not applied again event by event (the locked one
    would wait again): every job of it fails, and RQ retries it."""
    shop = factory.shop()
    order_id = factory.order(shop)
    for i in range(2, jobs + 1):
        factory.order(shop, f"order-{i}", f"pi_{i}")
    short = dataclasses.replace(settings, job_timeout=1, job_retry_intervals=(0,))
    queue = events_queue(redis_conn, short)
    events = [
        StandardEvent(),
        *(
            StandardEvent(gateway_order_id=f"pi_{i}", merchant_reference=f"order-{i}")
            for i in range(2, jobs + 1)
        ),
    ]
    queued = [enqueue_event(queue, factory.standard_envelope(shop, e), short) for e in events]
    with psycopg.connect(str(settings.database_url)) as holder:
        holder.execute("SELECT 1 FROM payhook.payment_orders WHERE id = %s FOR UPDATE", (order_id,))
        with released_after(holder) as released_by_watchdog:
            worker = build_worker(short, runtime)
            worker.work(burst=True, logging_level="ERROR")
            assert worker.applier is not None
            worker.applier.wait()
        assert not released_by_watchdog.is_set(), "the statement waited for the lock holder"
        holder.rollback()
    for job in queued:
        failed = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
        assert failed.get_status() == JobStatus.FAILED
        result = failed.latest_result()
        assert result is not None and "JobTimeoutException" in (result.exc_string or "")
    assert factory.count("payment_event_receipts") == 0, "the cancelled statement rolled back"


class ReplyLandsBeforeStop(PayhookWorker):
    """Lets the listener thread read the reply to UNSUBSCRIBE before anything
    else happens: the order in which a loaded machine runs RQ's teardown."""

    def subscribe(self) -> None:
        super().subscribe()  # type: ignore[no-untyped-call]
        pubsub = self.pubsub
        assert pubsub is not None
        send = pubsub.unsubscribe

        def unsubscribe(*args: Any) -> Any:
            sent = send(*args)  # type: ignore[no-untyped-call]
            wait_until(lambda: not pubsub.subscribed, 10, "the listener to read the reply")
            return sent

        pubsub.unsubscribe = unsubscribe  # type: ignore[method-assign]


def test_a_stopping_worker_does_not_wait_out_its_command_listener(
    settings: Settings, runtime: Runtime
) -> None:
    """The thread listening for RQ's worker commands ends as the worker stops.
    Stopped after UNSUBSCRIBE was answered, it went back to a 60 s wait for a
    subscription, and the worker waited for it (`payhook consumer --burst`
    and every SIGTERM took a minute)."""
    worker = built_as(ReplyLandsBeforeStop, settings, runtime)
    worker.subscribe()

    def hung(signum: int, frame: Any) -> None:
        raise TimeoutError("the worker is still waiting for its command listener")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        worker.unsubscribe()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

    assert worker.pubsub_thread is not None
    assert not worker.pubsub_thread.is_alive()
