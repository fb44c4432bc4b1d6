"""Operational counters kept in Redis, per minute, for alerts.

The consumer counts serialization-failure and deadlock retries here (not in
PostgreSQL: a retry storm is a database problem); `payhook check` and
`/metrics` read the sum over a window.
"""

from __future__ import annotations

import time

from redis import Redis

#: Key prefix of the per-minute buckets of transaction retries.
SERIALIZATION_RETRIES = "payhook:counter:serialization_retries"
#: Seconds a bucket is kept.
BUCKET_TTL = 2 * 3600


def record(redis: Redis, name: str, amount: int = 1, now: float | None = None) -> None:
    key = f"{name}:{int((now or time.time()) // 60)}"
    with redis.pipeline() as pipe:
        pipe.incrby(key, amount)
        pipe.expire(key, BUCKET_TTL)
        pipe.execute()


def total(redis: Redis, name: str, window: float, now: float | None = None) -> int:
    """The sum over the last `window` seconds (whole minutes, at most BUCKET_TTL)."""
    current = int((now or time.time()) // 60)
    minutes = max(1, min(int(window // 60), BUCKET_TTL // 60))
    values = redis.mget([f"{name}:{current - i}" for i in range(minutes)])
    return sum(int(v) for v in values if v is not None)
