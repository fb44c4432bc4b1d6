"""Alert signals, read from PostgreSQL and Redis, for `payhook check` and Prometheus.

Each signal is a count with a threshold; it is active when the count is above
the threshold. `payhook check` prints the active ones; `AlertCollector`
exports every signal as `payhook_alert_value` and `payhook_alert_threshold`
(label `alert`) for the rules in `ops/prometheus/alerts.yml`.

| variable | default | meaning |
|---|---|---|
| `PAYHOOK_ALERT_WINDOW` | 24h | how long a digest conflict or refused job keeps its alert on |
| `PAYHOOK_ALERT_RETRY_WINDOW` | 15m | window of the transaction-retry count (1m to 2h) |
| `PAYHOOK_ALERT_RETRY_THRESHOLD` | 20 | retries in that window above which it alerts |
| `PAYHOOK_ALERT_BACKLOG` | 5m | an event job waiting in the queue for longer alerts |
| `PAYHOOK_OUTBOX_SLA` | 5m | an outbox row undelivered for longer alerts |
| `PAYHOOK_ALERT_TIMEOUT` | 5s | longest a read of the signals may run or wait for a lock |

Like every duration, the windows are at most `payhook.settings.MAX_DURATION`
(a hundred years: PostgreSQL cannot subtract an interval of thousands of years
from now(), and every read would fail). A read that times out (a table locked
by a migration, `VACUUM FULL`, a `LOCK`) raises `AlertsUnavailable`, as when
PostgreSQL is down: `payhook check` then exits 2 and the export reports
`payhook_alerts_up 0`, rather than hanging.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TextIO

import psycopg
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError
from rq import Queue
from rq.registry import FailedJobRegistry, ScheduledJobRegistry
from rq.utils import utcparse

from payhook import counters, quarantine
from payhook.db import Row, connect, fetch_one
from payhook.errors import PayhookError, SettingsError
from payhook.queue import events_queue, redis_connection
from payhook.settings import MAX_DURATION, Settings, parse_duration, positive_duration, positive_int

#: Seconds a payload-digest conflict or a refused job keeps its alert active.
DEFAULT_WINDOW = 24 * 3600.0
#: Seconds an event job may wait in the queue before the backlog alerts.
DEFAULT_BACKLOG = 300.0
#: Job ids read from the head of the queue, at most, for the backlog's age.
BACKLOG_PROBE = 10
#: Seconds over which transaction retries are summed.
DEFAULT_RETRY_WINDOW = 15 * 60.0
#: Retries in the window above which the retry alert is active.
DEFAULT_RETRY_THRESHOLD = 20
#: Seconds one read of the signals may run, lock waits included, before the
#: server cancels it and the signals are reported unreadable.
DEFAULT_TIMEOUT = 5.0
#: Longest timeout, in seconds, `PAYHOOK_ALERT_TIMEOUT` may set.
MAX_TIMEOUT = 600.0

#: Every signal, in the order `payhook check` prints them.
SIGNALS = (
    "digest_conflicts",
    "rejected_jobs",
    "unmapped_events",
    "late_events",
    "open_exceptions",
    "queue_backlog",
    "serialization_retries",
    "outbox_overdue",
    "outbox_dead",
    "dead_letter_jobs",
    "quarantined_jobs",
    "missed_events",
)


class AlertsUnavailable(PayhookError):
    """The alert signals could not be read."""


@dataclass(frozen=True)
class AlertSettings:
    """Windows and the read timeout in seconds."""

    window: float = DEFAULT_WINDOW
    retry_window: float = DEFAULT_RETRY_WINDOW
    retry_threshold: int = DEFAULT_RETRY_THRESHOLD
    outbox_sla: float = 300.0
    backlog: float = DEFAULT_BACKLOG
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def from_settings(cls, settings: Settings) -> AlertSettings:
        """Read the `PAYHOOK_ALERT_*` variables; a bad one raises `SettingsError` naming it."""
        extra = settings.extra
        window = _bounded(extra, "PAYHOOK_ALERT_WINDOW", DEFAULT_WINDOW)
        retry_window = DEFAULT_RETRY_WINDOW
        if "PAYHOOK_ALERT_RETRY_WINDOW" in extra:
            name = "PAYHOOK_ALERT_RETRY_WINDOW"
            retry_window = parse_duration(name, extra[name])
            if not 60 <= retry_window <= counters.BUCKET_TTL:
                raise SettingsError(
                    f"{name}: expected 1m to {counters.BUCKET_TTL // 60}m "
                    f"(the counters keep {counters.BUCKET_TTL // 60} minutes), got {extra[name]!r}"
                )
        threshold = DEFAULT_RETRY_THRESHOLD
        if "PAYHOOK_ALERT_RETRY_THRESHOLD" in extra:
            name = "PAYHOOK_ALERT_RETRY_THRESHOLD"
            threshold = positive_int(name, extra[name])
        backlog = _bounded(extra, "PAYHOOK_ALERT_BACKLOG", DEFAULT_BACKLOG)
        timeout = _bounded(extra, "PAYHOOK_ALERT_TIMEOUT", DEFAULT_TIMEOUT, MAX_TIMEOUT)
        return cls(window, retry_window, threshold, settings.outbox_sla, backlog, timeout)


def _bounded(
    extra: Mapping[str, str], name: str, default: float, most: float = MAX_DURATION
) -> float:
    """The duration variable `name`, above zero and at most `most` seconds."""
    return positive_duration(name, extra[name], most) if name in extra else default


@dataclass(frozen=True)
class Signal:
    name: str
    value: int
    threshold: int
    #: What the count is, for people.
    description: str

    @property
    def active(self) -> bool:
        return self.value > self.threshold

    def line(self) -> str:
        """The line `payhook check` prints."""
        return f"{self.name} {self.value} {self.description}"


def read_signals(
    conn: psycopg.Connection[Row], redis: Redis, settings: Settings, config: AlertSettings
) -> list[Signal]:
    """Every signal, now. `AlertsUnavailable` when PostgreSQL or Redis does not answer,
    or PostgreSQL not within `config.timeout` (a lock held on a table it reads)."""
    timeout_ms = str(max(1, int(config.timeout * 1000)))
    try:
        with conn.transaction():
            fetch_one(conn, "limit_alert_reads", {"timeout_ms": timeout_ms})
            row = fetch_one(
                conn, "count_alert_signals", {"window": config.window, "sla": config.outbox_sla}
            )
    except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable) as exc:
        raise AlertsUnavailable(
            f"PostgreSQL: no answer within {_duration(config.timeout)} "
            f"(PAYHOOK_ALERT_TIMEOUT); is a table it reads locked? {exc}".strip()
        ) from exc
    except psycopg.Error as exc:
        raise AlertsUnavailable(f"PostgreSQL: {exc}".strip()) from exc
    assert row is not None
    try:
        queue = events_queue(redis, settings)
        retries = counters.total(redis, counters.SERIALIZATION_RETRIES, config.retry_window)
        dead_letters = FailedJobRegistry(queue=queue).get_job_count(cleanup=False)
        quarantined = quarantine.count(redis, settings.queue)
        backlog = oldest_waiting(queue)
    except RedisError as exc:
        raise AlertsUnavailable(f"Redis: {exc}") from exc
    return [
        Signal(
            "digest_conflicts",
            int(row["digest_conflicts"]),
            0,
            f"payload-digest conflicts in the last {_duration(config.window)}",
        ),
        Signal(
            "rejected_jobs",
            int(row["rejected_jobs"]),
            0,
            "jobs the consumer refused (signature, endpoint or job unusable) "
            f"in the last {_duration(config.window)}",
        ),
        Signal(
            "unmapped_events",
            int(row["unmapped_events"]),
            0,
            "authentic events not mapped to an order (open exceptions)",
        ),
        Signal(
            "late_events",
            int(row["late_events"]),
            0,
            "authentic events refused as older than the retention horizon (open exceptions)",
        ),
        Signal(
            "open_exceptions",
            int(row["open_exceptions"]),
            0,
            "authentic events refused by the business rules (mismatches, invalid "
            "transitions, second payments, unreadable bodies; open exceptions)",
        ),
        Signal(
            "queue_backlog",
            int(backlog),
            int(config.backlog),
            f"seconds the oldest event job has waited in the queue or past its retry time "
            f"(alerts above {_duration(config.backlog)})",
        ),
        Signal(
            "serialization_retries",
            retries,
            config.retry_threshold,
            f"transaction retries in the last {_duration(config.retry_window)} "
            f"(alerts above {config.retry_threshold})",
        ),
        Signal(
            "outbox_overdue",
            int(row["outbox_overdue"]),
            0,
            f"outbox rows undelivered after {_duration(config.outbox_sla)}",
        ),
        Signal("outbox_dead", int(row["outbox_dead"]), 0, "dead outbox rows"),
        Signal("dead_letter_jobs", dead_letters, 0, "event jobs in the dead-letter queue"),
        Signal(
            "quarantined_jobs",
            quarantined,
            0,
            "jobs in Redis the consumers could not read, set aside (`payhook quarantine list`)",
        ),
        Signal(
            "missed_events",
            int(row["missed_events"]),
            0,
            "events the gateway's API listed that had never arrived, found by "
            f"`payhook reconcile` in the last {_duration(config.window)}",
        ),
    ]


def oldest_waiting(queue: Queue) -> float:
    """Seconds the oldest job of `queue` has waited; 0 if none.

    A queued job waits from when it was enqueued. Workers take jobs from the
    head, so while consumers keep up this stays near zero; it grows when they
    are down, stuck or outpaced. A head id without a readable job (gone, or
    its time unreadable) is passed over for the next, up to `BACKLOG_PROBE` of
    them. A job scheduled for a retry (with backoff, while the database was
    down) waits from its retry time: the consumers' schedulers move it onto
    the queue within a second of it, so one overdue means no consumer runs.
    """
    overdue = _oldest_overdue(ScheduledJobRegistry(queue=queue))
    return max(_oldest_queued(queue), overdue)


def _oldest_overdue(registry: ScheduledJobRegistry) -> float:
    """Seconds past its time of the earliest scheduled job; 0 if none is due."""
    earliest = registry.connection.zrange(registry.key, 0, 0, withscores=True)
    if not earliest:
        return 0.0
    return max(0.0, time.time() - float(earliest[0][1]))


def _oldest_queued(queue: Queue) -> float:
    for job_id in queue.get_job_ids(0, BACKLOG_PROBE):
        raw = queue.connection.hget(queue.job_class.key_for(job_id), "enqueued_at")
        if not raw:
            continue
        try:
            enqueued_at = utcparse(raw.decode() if isinstance(raw, bytes) else str(raw))
        except ValueError:
            continue
        return max(0.0, (datetime.now(UTC) - enqueued_at).total_seconds())
    return 0.0


class AlertCollector(Collector):
    """Prometheus collector: reads the signals at scrape time.

    `read` returns the signals or raises; a failed read exports
    `payhook_alerts_up 0` and no signal values, so the rules see the gap.
    """

    def __init__(self, read: Callable[[], list[Signal]]) -> None:
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(
            "payhook_alerts_up", "1 when the alert signals could be read at this scrape."
        )
        try:
            signals = self.read()
        except (AlertsUnavailable, psycopg.Error, RedisError):
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        value = GaugeMetricFamily(
            "payhook_alert_value",
            "Current count of an alert signal, as `payhook check` computes it.",
            labels=["alert"],
        )
        threshold = GaugeMetricFamily(
            "payhook_alert_threshold",
            "The count above which the alert signal is active.",
            labels=["alert"],
        )
        for signal in signals:
            value.add_metric([signal.name], signal.value)
            threshold.add_metric([signal.name], signal.threshold)
        yield value
        yield threshold


def _duration(seconds: float) -> str:
    """`24h`, `2d`, `15m`, `90s`: days only from two days on."""
    for unit, size, least in (("d", 86400, 2), ("h", 3600, 1), ("m", 60, 1)):
        if seconds >= least * size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def check(settings: Settings, *, show_all: bool = False, out: TextIO = sys.stdout) -> int:
    """`payhook check`: one line per active alert; 1 when any is active, else 0."""
    config = AlertSettings.from_settings(settings)
    redis = redis_connection(settings, timeout=10)
    try:
        with connect(settings, "check") as conn:
            signals = read_signals(conn, redis, settings, config)
    finally:
        redis.close()
    active = [s for s in signals if s.active]
    for signal in signals if show_all else active:
        print(signal.line() + (" [active]" if show_all and signal.active else ""), file=out)
    return 1 if active else 0
