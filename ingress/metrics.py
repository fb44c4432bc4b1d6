"""Prometheus metrics of one ingress process, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Bounds of the enqueue latency histogram, in seconds.
ENQUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._request_children: dict[tuple[str, int], Counter] = {}
        self.requests = Counter(
            "payhook_ingress_requests",
            "Webhook requests answered, by gateway and HTTP status.",
            ["gateway", "status"],
            registry=self.registry,
        )
        self.signature_failures = Counter(
            "payhook_ingress_signature_failures",
            "Requests refused by signature verification, by gateway and reason.",
            ["gateway", "reason"],
            registry=self.registry,
        )
        self.enqueue_seconds = Histogram(
            "payhook_ingress_enqueue_seconds",
            "Seconds from handing a job to Redis to Redis accepting it.",
            buckets=ENQUEUE_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "payhook_ingress_queue_depth",
            "Jobs waiting in the events queue, read at scrape time (NaN: Redis did not answer).",
            registry=self.registry,
        )
        self.endpoints = Gauge(
            "payhook_ingress_endpoints",
            "Endpoints in the in-memory cache.",
            registry=self.registry,
        )
        self.endpoints_age = Gauge(
            "payhook_ingress_endpoints_age_seconds",
            "Seconds since the endpoint cache was last refreshed (NaN: never loaded).",
            registry=self.registry,
        )
        self.endpoint_refreshes = Counter(
            "payhook_ingress_endpoint_refreshes",
            "Endpoint cache refreshes, by result (ok, failed).",
            ["result"],
            registry=self.registry,
        )

    def count_request(self, gateway: str, status: int) -> None:
        key = (gateway, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(gateway, str(status))
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
