"""The dashboard's `/metrics` of how events flow: the histograms `payhook.flow`
keeps in Redis, and the events queue's depth and oldest job, read at scrape
time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError

from control.alerts import oldest_waiting
from payhook import flow
from payhook.queue import events_queue
from payhook.settings import Settings

HELP = {
    flow.RECEIPT_TO_COMMIT: "Seconds from the ingress receiving a webhook to its event's commit.",
    flow.COMMIT_TO_DELIVERY: "Seconds from an event's commit to its outbox row's delivery.",
}


class FlowCollector(Collector):
    """Reads Redis at scrape time; exports nothing of what it could not read
    (`payhook_alerts_up` says whether Redis answered)."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        try:
            histograms = {name: flow.read(self.redis, name) for name in flow.NAMES}
            queue = events_queue(self.redis, self.settings)
            depth = queue.count
            oldest = oldest_waiting(queue)
        except RedisError:
            return
        for name, found in histograms.items():
            family = HistogramMetricFamily(
                f"payhook_{name}_seconds", HELP[name], labels=["gateway"]
            )
            for histogram in found:
                family.add_metric([histogram.gateway], histogram.buckets, histogram.total)
            yield family
        yield GaugeMetricFamily(
            "payhook_queue_depth", "Event jobs waiting in the events queue.", value=depth
        )
        yield GaugeMetricFamily(
            "payhook_queue_oldest_job_seconds",
            "Seconds the oldest event job has waited in the queue or past its retry time.",
            value=oldest,
        )
