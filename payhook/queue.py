"""The RQ events queue, shared by the ingress (enqueue) and the consumer (work).

Jobs are JSON, never pickle, and name the consumer's job function by its
import path, so the ingress never imports the consumer.
"""

from __future__ import annotations

import math

from redis import Redis
from rq import Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from payhook.envelope import Envelope
from payhook.settings import Settings

#: Import path of the only function a consumer runs.
APPLY_EVENT = "consumer.jobs.apply_event"
#: Seconds a failed job stays in the dead-letter queue (FailedJobRegistry).
FAILURE_TTL = 30 * 86400


def redis_connection(settings: Settings, *, timeout: float | None = None) -> Redis:
    return Redis.from_url(
        settings.redis_url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout or 5,
        health_check_interval=30,
    )


def events_queue(connection: Redis, settings: Settings) -> Queue:
    return Queue(settings.queue, connection=connection, serializer=JSONSerializer)


def retry_policy(settings: Settings) -> Retry:
    intervals = list(settings.job_retry_intervals)
    return Retry(max=len(intervals), interval=intervals)


def enqueue_event(queue: Queue, envelope: Envelope, settings: Settings) -> Job:
    """Put one event on the queue; returns once Redis has accepted the job."""
    return queue.enqueue(
        APPLY_EVENT,
        envelope.to_json(),
        job_id=envelope.delivery_id,
        job_timeout=settings.job_timeout,
        result_ttl=math.ceil(settings.result_ttl),
        failure_ttl=FAILURE_TTL,
        retry=retry_policy(settings),
        description=f"apply_event delivery={envelope.delivery_id}",
    )
