"""How events flow, as histograms: the consumer's receipt-to-commit and the
outbox worker's commit-to-delivery, per gateway, kept in Redis and exported by
the dashboard's `/metrics` beside the queue's depth and oldest job."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from consumer.handler import Runtime, handle
from control.dashboard import create_app
from outbox_worker.config import OutboxSettings
from outbox_worker.loop import Worker
from outbox_worker.main import build_client
from payhook import flow
from payhook.db import create_pool
from payhook.envelope import Envelope
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import LOCAL_RECEIVERS, TEST_KEYRING, Factory, StandardEvent
from tests.receiver import Receiver

USER, PASSWORD = "operator", "flow-metrics-password"


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver") as running:
        yield running


def test_a_recorder_adds_its_observations_to_redis_at_most_once_a_second(
    redis_conn: Redis,
) -> None:
    recorder = flow.FlowRecorder(flow.RECEIPT_TO_COMMIT, flush_every=3600)
    for seconds in (0.003, 0.04, 0.04, 7.0, 10_000.0):
        recorder.observe("stripe", seconds)
    recorder.flush_due(redis_conn)
    assert flow.read(redis_conn, flow.RECEIPT_TO_COMMIT) == []  # not yet due
    # Redis away: kept, and added with the next flush.
    broken = Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    recorder.flush(broken)
    recorder.observe("stripe", 0.003)
    recorder.flush(redis_conn)
    (histogram,) = flow.read(redis_conn, flow.RECEIPT_TO_COMMIT)
    counts = dict(histogram.buckets)
    assert histogram.gateway == "stripe"
    assert (counts["0.005"], counts["0.05"], counts["10"], counts["3600"], counts["+Inf"]) == (
        2,
        4,
        5,
        5,
        6,
    )
    assert histogram.total == pytest.approx(10_007.086)
    with pytest.raises(RedisConnectionError):
        broken.ping()


def test_the_stack_measures_receipt_to_commit_and_commit_to_delivery(
    settings: Settings, factory: Factory, redis_conn: Redis, receiver: Receiver
) -> None:
    shop = factory.shop(fulfilment_url=receiver.url)
    factory.order(shop, amount=2500)
    event = StandardEvent(amount=2500)
    job = factory.standard_envelope(shop, event)
    # Received by the ingress 2 s ago.
    job = Envelope(job.endpoint_id, job.body, job.headers, job.received_at - timedelta(seconds=2),
                   job.delivery_id)  # fmt: skip
    runtime = Runtime(
        settings=settings, pool=create_pool(settings, "test", size=1), redis=redis_conn
    )
    runtime.pool.open(wait=True)
    try:
        assert handle(runtime, job.to_json()).outcome == "applied"
        assert handle(runtime, job.to_json()).outcome == "duplicate"  # not measured again
        runtime.flow.flush(redis_conn)
    finally:
        runtime.pool.close()
    (commit,) = flow.read(redis_conn, flow.RECEIPT_TO_COMMIT)
    assert commit.gateway == "standard" and commit.buckets[-1][1] == 1
    assert 2 <= commit.total < 10

    config = OutboxSettings(lease=6.0, timeout=2.0, destinations=LOCAL_RECEIVERS)
    pool = create_pool(settings, "test", size=2)
    pool.open(wait=True)
    worker = Worker(pool, build_client(config), config, keyring=TEST_KEYRING, redis=redis_conn)
    try:
        assert worker.run_once() == 1
        worker.flow.flush(redis_conn)
    finally:
        worker.close()
        worker.client.close()
        pool.close()
    (delivery,) = flow.read(redis_conn, flow.COMMIT_TO_DELIVERY)
    assert delivery.gateway == "standard" and delivery.buckets[-1][1] == 1

    # One job waiting 90 s in the queue, beside the histograms.
    waiting = factory.standard_envelope(shop, StandardEvent())
    queued = enqueue_event(events_queue(redis_conn, settings), waiting, settings)
    ninety_ago = (datetime.now(UTC) - timedelta(seconds=90)).isoformat()
    redis_conn.hset(queued.key, "enqueued_at", ninety_ago.replace("+00:00", "Z"))
    client = create_app(settings, USER, PASSWORD).test_client()
    text = client.get("/metrics", auth=(USER, PASSWORD)).get_data(as_text=True)
    assert 'payhook_receipt_to_commit_seconds_count{gateway="standard"} 1.0' in text
    assert 'payhook_commit_to_delivery_seconds_count{gateway="standard"} 1.0' in text
    assert 'payhook_receipt_to_commit_seconds_bucket{gateway="standard",le="+Inf"} 1.0' in text
    assert "payhook_queue_depth 1.0" in text
    oldest = next(
        float(line.split()[1]) for line in text.splitlines()
        if line.startswith("payhook_queue_oldest_job_seconds ")
    )  # fmt: skip
    assert 90 <= oldest < 120
