"""How long events take to flow through payhook, as histograms kept in Redis.

Two are kept, per gateway: from the ingress receiving a webhook to the
consumer's commit (`receipt_to_commit`), and from that commit to the outbox
worker's delivery (`commit_to_delivery`). Each process counts its
observations in memory and adds them to Redis at most once a second (one
pipeline of `HINCRBY`s), so the hot path pays no round trip of its own; the
dashboard's `/metrics` exports the totals as Prometheus histograms. Counts
are cumulative, as Prometheus counters are: a Redis without them (a restart
with no persistence) is a counter reset, which `rate()` handles. What a
process held when it was killed is lost: these are measurements, not records.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from redis import Redis
from redis.exceptions import RedisError

#: Bucket upper bounds, in seconds: from a few milliseconds (a consumer with
#: nothing queued) to an hour (an outage), then +Inf.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
           900.0, 3600.0)  # fmt: skip
RECEIPT_TO_COMMIT = "receipt_to_commit"
COMMIT_TO_DELIVERY = "commit_to_delivery"
NAMES = (RECEIPT_TO_COMMIT, COMMIT_TO_DELIVERY)
#: Seconds between two flushes of a process's observations.
FLUSH_EVERY = 1.0
KEY = "payhook:flow:{name}:{gateway}"


def _key(name: str, gateway: str) -> str:
    return KEY.format(name=name, gateway=gateway)


@dataclass
class Pending:
    """Observations not yet added to Redis: per bucket (the last is +Inf)."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    count: int = 0
    total: float = 0.0


class FlowRecorder:
    """One process's observations of one histogram, flushed to Redis."""

    def __init__(self, name: str, flush_every: float = FLUSH_EVERY) -> None:
        self.name = name
        self.flush_every = flush_every
        self._pending: dict[str, Pending] = defaultdict(Pending)
        self._flushed_at = time.monotonic()
        #: The outbox worker observes from its delivery threads.
        self._lock = threading.Lock()

    def observe(self, gateway: str, seconds: float) -> None:
        if not math.isfinite(seconds):
            return
        seconds = max(0.0, seconds)
        index = next((i for i, bound in enumerate(BUCKETS) if seconds <= bound), len(BUCKETS))
        with self._lock:
            pending = self._pending[gateway]
            pending.buckets[index] += 1
            pending.count += 1
            pending.total += seconds

    def flush_due(self, redis: Redis | None) -> None:
        """Flush if FLUSH_EVERY has passed since the last."""
        if redis is not None and time.monotonic() - self._flushed_at >= self.flush_every:
            self.flush(redis)

    def flush(self, redis: Redis) -> None:
        """Add what is pending to Redis; kept for the next flush if Redis fails."""
        with self._lock:
            self._flushed_at = time.monotonic()
            if not self._pending:
                return
            pending, self._pending = self._pending, defaultdict(Pending)
        try:
            with redis.pipeline(transaction=False) as pipe:
                for gateway, seen in pending.items():
                    key = _key(self.name, gateway)
                    for index, n in enumerate(seen.buckets):
                        if n:
                            pipe.hincrby(key, f"b{index}", n)
                    pipe.hincrby(key, "count", seen.count)
                    pipe.hincrbyfloat(key, "sum", seen.total)
                pipe.execute()
        except (RedisError, OSError):
            with self._lock:  # not lost: added next time
                for gateway, seen in pending.items():
                    kept = self._pending[gateway]
                    kept.buckets = [a + b for a, b in zip(kept.buckets, seen.buckets, strict=True)]
                    kept.count += seen.count
                    kept.total += seen.total


@dataclass(frozen=True)
class Histogram:
    """A histogram as Prometheus exports it: cumulative counts per upper bound."""

    gateway: str
    #: (upper bound as text, cumulative count), +Inf last.
    buckets: list[tuple[str, int]]
    total: float


def read(redis: Redis, name: str) -> list[Histogram]:
    """Every gateway's histogram `name`, as kept in Redis."""
    prefix = _key(name, "")
    found = []
    for key in sorted(redis.scan_iter(match=prefix + "*", count=100)):
        key_text = key.decode() if isinstance(key, bytes) else str(key)
        fields = {
            (k.decode() if isinstance(k, bytes) else k): v
            for k, v in redis.hgetall(key_text).items()
        }
        running = 0
        buckets = []
        for index in range(len(BUCKETS) + 1):
            running += int(fields.get(f"b{index}", 0))
            bound = "+Inf" if index == len(BUCKETS) else f"{BUCKETS[index]:g}"
            buckets.append((bound, running))
        found.append(Histogram(key_text[len(prefix) :], buckets, float(fields.get("sum", 0.0))))
    return found
