"""A consumer takes several jobs at once and commits their events together,
each job still an RQ job with its own outcome."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from typing import Any, cast

import psycopg
import pytest
from redis import Redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.worker import Worker

from consumer import handler, transaction
from consumer.handler import Runtime, handle_many
from consumer.main import build_worker
from consumer.transaction import lock_order
from payhook.errors import DatabaseError
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import Factory, Shop, StandardEvent, envelope


def fetch(redis_conn: Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)


def outcome(redis_conn: Redis, job_id: str) -> str:
    return str(cast(dict[str, Any], fetch(redis_conn, job_id).return_value())["outcome"])


def paid(factory: Factory, shop: Shop, i: int) -> StandardEvent:
    """A payment of an order of its own, `order-<i>`."""
    factory.order(shop, f"order-{i}", f"pi_{i}")
    return StandardEvent(gateway_order_id=f"pi_{i}", merchant_reference=f"order-{i}")


def test_a_batch_commits_once_and_each_of_its_jobs_finishes_as_an_rq_job(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    events = [paid(factory, shop, i) for i in range(6)]
    jobs = [enqueue_event(queue, factory.standard_envelope(shop, e), settings).id for e in events]
    again = [
        enqueue_event(queue, factory.standard_envelope(shop, events[0]), settings).id
        for _ in range(2)
    ]

    worker = build_worker(settings, runtime)
    assert worker.batch_size == settings.consumer_batch > len(jobs) + len(again)
    worker.work(burst=True, logging_level="ERROR")

    assert [outcome(redis_conn, j) for j in jobs] == ["applied"] * 6
    assert [outcome(redis_conn, j) for j in again] == ["duplicate"] * 2
    commits = factory.conn.execute(
        "SELECT count(DISTINCT xmin::text) AS n FROM payhook.payment_event_receipts"
    ).fetchone()
    assert commits is not None and commits["n"] == 1, "one transaction for the batch"
    assert factory.count("payment_order_transitions") == 6
    assert factory.count("payment_outbox") == 6
    # What RQ's own worker would have left: finished jobs with their results,
    # nothing started or waiting, the worker's counters.
    for job_id in [*jobs, *again]:
        job = fetch(redis_conn, job_id)
        assert job.get_status() == JobStatus.FINISHED
        assert job.worker_name == worker.name
        assert job.started_at is not None and job.ended_at is not None
        assert len(job.results()) == 1
    assert sorted(queue.finished_job_registry.get_job_ids()) == sorted([*jobs, *again])
    assert queue.started_job_registry.get_job_ids() == []
    assert queue.intermediate_queue.get_job_ids() == []
    assert queue.get_job_ids() == []
    assert redis_conn.keys("rq:execution:*") == []
    counted = Worker.find_by_key(worker.key, connection=redis_conn)
    assert counted is not None and counted.successful_job_count == 8


def test_the_events_of_one_order_apply_in_the_order_they_were_queued(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    """A payment, then its refund, which names the order by the gateway's id
    only: in one batch, as one at a time, the refund finds the order paid."""
    shop = factory.shop()
    order_id = factory.order(shop, "order-9", "pi_9", amount=3000)
    others = [paid(factory, shop, i) for i in range(3)]
    pay = StandardEvent(gateway_order_id="pi_9", merchant_reference="order-9", amount=3000)
    refund = StandardEvent(
        type="payment.refunded", gateway_order_id="pi_9", merchant_reference=None, amount=1000
    )
    queue = events_queue(redis_conn, settings)
    jobs = [
        enqueue_event(queue, factory.standard_envelope(shop, e), settings).id
        for e in (others[2], pay, others[0], refund, others[1])
    ]

    build_worker(settings, runtime).work(burst=True, logging_level="ERROR")

    assert [outcome(redis_conn, j) for j in jobs] == ["applied"] * 5
    assert factory.order_state(shop, order_id) == "partially_refunded"
    assert factory.count("payment_exceptions") == 0


def test_an_event_whose_statement_fails_leaves_the_rest_of_its_batch_applied(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    """The batch's transaction rolls back; each event is then applied in one
    of its own: the failing one's job fails (retried, then dead-lettered),
    the others finish applied, once."""
    once = dataclasses.replace(settings, job_retry_intervals=(0,))
    shop = factory.shop()
    events = [paid(factory, shop, i) for i in range(4)]
    factory.conn.execute(
        """
        CREATE FUNCTION payhook.test_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'poisoned order';
        END $$;
        CREATE TRIGGER test_poison BEFORE UPDATE ON payhook.payment_orders
            FOR EACH ROW WHEN (NEW.merchant_reference = 'order-2')
            EXECUTE FUNCTION payhook.test_poison();
        """
    )
    factory.conn.commit()
    queue = events_queue(redis_conn, once)
    jobs = [enqueue_event(queue, factory.standard_envelope(shop, e), once).id for e in events]

    worker = build_worker(once, runtime)
    worker.work(burst=True, logging_level="ERROR")

    assert [outcome(redis_conn, j) for i, j in enumerate(jobs) if i != 2] == ["applied"] * 3
    poisoned = fetch(redis_conn, jobs[2])
    assert poisoned.get_status() == JobStatus.FAILED
    assert queue.failed_job_registry.get_job_ids() == [jobs[2]]
    result = poisoned.latest_result()
    assert result is not None and "DatabaseError" in (result.exc_string or "")
    assert "poisoned order" not in (result.exc_string or ""), "SQLSTATE only, never the text"
    # RQ's own failure handling: retried once (PAYHOOK_JOB_RETRY_INTERVALS=0), then failed.
    counted = Worker.find_by_key(worker.key, connection=redis_conn)
    assert counted is not None
    assert (counted.failed_job_count, counted.successful_job_count) == (2, 3)
    assert factory.count("payment_event_receipts") == 3
    assert factory.count("payment_order_transitions") == 3
    assert factory.count("payment_outbox") == 3


def test_a_forged_job_in_a_batch_is_dead_lettered_unretried_and_the_rest_applied(
    settings: Settings, redis_conn: Redis, factory: Factory, runtime: Runtime
) -> None:
    """A job whose signature does not verify is refused: recorded as an
    anomaly, failed into the dead-letter queue without RQ's retries (they
    would only record it again); the batch's other events are applied."""
    once = dataclasses.replace(settings, job_retry_intervals=(0,))
    shop, stranger = factory.shop(), factory.shop()
    events = [paid(factory, shop, i) for i in range(3)]
    queue = events_queue(redis_conn, once)
    jobs = [enqueue_event(queue, factory.standard_envelope(shop, e), once).id for e in events]
    body = events[1].body()
    forged = envelope(shop, body, events[1].headers(stranger.secret, body))
    forged_id = enqueue_event(queue, forged, once).id

    worker = build_worker(once, runtime)
    worker.work(burst=True, logging_level="ERROR")

    refused = fetch(redis_conn, forged_id)
    assert refused.get_status() == JobStatus.FAILED
    assert queue.failed_job_registry.get_job_ids() == [forged_id]
    result = refused.latest_result()
    assert result is not None and "RefusedJob" in (result.exc_string or "")
    counted = Worker.find_by_key(worker.key, connection=redis_conn)
    assert counted is not None
    assert (counted.failed_job_count, counted.successful_job_count) == (1, 3), "not retried"
    assert [outcome(redis_conn, j) for j in jobs] == ["applied"] * 3
    assert factory.count("security_anomalies", kind="signature_invalid") == 1
    assert factory.count("payment_order_transitions") == 3


def test_batches_of_the_same_events_in_opposite_orders_do_not_deadlock(
    settings: Settings, factory: Factory, runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two consumers, real threads, each with a batch of the same twenty
    events (other deliveries of them) queued in opposite orders: their
    transactions lock the orders in one order, so neither waits on the
    other in a cycle, and each event is applied once."""
    shop = factory.shop()
    events = [paid(factory, shop, i) for i in range(20)]
    batches = [
        [factory.standard_envelope(shop, e).to_json() for e in events],
        [factory.standard_envelope(shop, e).to_json() for e in reversed(events)],
    ]
    one_by_one = []
    apply_alone = transaction.apply_with_retries

    def counted(*args: Any, **kwargs: Any) -> Any:
        one_by_one.append(args)
        return apply_alone(*args, **kwargs)

    monkeypatch.setattr(handler, "apply_with_retries", counted)
    outcomes: list[str] = []
    failures: list[BaseException] = []
    start = threading.Barrier(2)

    def consume(batch: list[Any]) -> None:
        start.wait()
        try:
            for result in handle_many(runtime, batch):
                assert not isinstance(result, Exception), result
                outcomes.append(result.outcome)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=consume, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    assert Counter(outcomes) == {"applied": 20, "duplicate": 20}
    assert factory.count("payment_order_transitions") == 20
    assert factory.count("payment_outbox") == 20
    assert one_by_one == [], "a batch's transaction failed (a deadlock) and fell back"


def test_the_lock_order_keeps_each_order_s_events_in_queue_order() -> None:
    def call(reference: str | None, order: str | None, tenant: str = "t") -> dict[str, Any]:
        event = {"merchant_reference": reference, "gateway_order_id": order}
        return {"tenant_id": tenant, "event": psycopg.types.json.Jsonb(event)}

    calls = [
        call("order-b", "pi_b"),  # 0
        call("order-a", "pi_a"),  # 1
        call(None, "pi_b"),  # 2: order-b's refund, by the gateway's id alone
        call("order-a", None),  # 3: order-a, by the merchant's reference alone
        call("order-a", "pi_a", tenant="s"),  # 4: another tenant's
    ]
    assert lock_order(calls) == [4, 1, 3, 0, 2]


def test_a_batch_of_an_unknown_database_error_raises_it_as_its_sqlstate_only(
    settings: Settings, factory: Factory, runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    shop = factory.shop()
    events = [paid(factory, shop, i) for i in range(2)]
    batch = [factory.standard_envelope(shop, e).to_json() for e in events]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise psycopg.errors.UndefinedFunction("payhook.apply_event_v2(secret text)")

    monkeypatch.setattr(handler, "apply_with_retries", broken)
    monkeypatch.setattr(handler, "apply_events", broken)
    results = handle_many(runtime, batch)
    assert [type(r) for r in results] == [DatabaseError, DatabaseError]
    assert all("secret" not in str(r) for r in results)
