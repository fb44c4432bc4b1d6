"""The RQ events queue, shared by the ingress (enqueue) and the consumer (work).

Jobs are JSON, never pickle, and name the consumer's job function by its
import path, so the ingress never imports the consumer.
"""

from __future__ import annotations

import math
from typing import Any

from redis import Redis
from rq import Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from payhook.envelope import Envelope
from payhook.errors import UnreadableJob
from payhook.jobhash import check_job_hash, data_bound
from payhook.redis_client import sync_client
from payhook.settings import Settings

#: Import path of the only function a consumer runs.
APPLY_EVENT = "consumer.jobs.apply_event"
#: Seconds a failed job stays in the dead-letter queue (FailedJobRegistry).
FAILURE_TTL = 30 * 86400


class ReadableJob(Job):
    """An RQ job whose hash is checked before RQ reads it (`payhook.jobhash`):
    `UnreadableJob` naming the field, never whatever RQ would raise, and data
    that would expand past `max_data` bytes is never expanded."""

    #: Most bytes a job's data may expand to; a consumer sets it from its
    #: PAYHOOK_MAX_BODY.
    max_data = data_bound(Settings.max_body)

    def restore(self, raw_data: Any) -> Any:
        try:
            check_job_hash(raw_data, self.max_data)
            return super().restore(raw_data)
        except UnreadableJob:
            raise
        except Exception as exc:  # whatever else RQ's restore raises on a field
            raise UnreadableJob(f"RQ could not read it ({exc.__class__.__name__})") from None


def redis_connection(settings: Settings, *, timeout: float | None = None) -> Redis:
    """A client of the queue's Redis (`payhook.redis_client`: a URL, or Sentinels)."""
    return sync_client(
        settings,
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
