"""Alert signals, read from PostgreSQL and Redis, for `payhook check` and Prometheus.

Each signal is a count with a threshold; it is active when the count is above
the threshold. `payhook check` prints the active ones; `AlertCollector`
exports every signal as `payhook_alert_value` and `payhook_alert_threshold`
(label `alert`) for the rules in `ops/prometheus/alerts.yml`.

| variable | default | meaning |
|---|---|---|
| `PAYHOOK_ALERT_WINDOW` | 24h | how long a payload-digest conflict keeps its alert active |
| `PAYHOOK_ALERT_RETRY_WINDOW` | 15m | window of the transaction-retry count (1m to 2h) |
| `PAYHOOK_ALERT_RETRY_THRESHOLD` | 20 | retries in that window above which it alerts |
| `PAYHOOK_OUTBOX_SLA` | 5m | an outbox row undelivered for longer alerts |
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO

import psycopg
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError
from rq.registry import FailedJobRegistry

from payhook import counters
from payhook.db import Row, connect, fetch_one
from payhook.errors import PayhookError, SettingsError
from payhook.queue import events_queue, redis_connection
from payhook.settings import Settings, parse_duration, positive_int

#: Seconds a payload-digest conflict keeps its alert active.
DEFAULT_WINDOW = 24 * 3600.0
#: Seconds over which transaction retries are summed.
DEFAULT_RETRY_WINDOW = 15 * 60.0
#: Retries in the window above which the retry alert is active.
DEFAULT_RETRY_THRESHOLD = 20

#: Every signal, in the order `payhook check` prints them.
SIGNALS = (
    "digest_conflicts",
    "unmapped_events",
    "late_events",
    "serialization_retries",
    "outbox_overdue",
    "outbox_dead",
    "dead_letter_jobs",
)


class AlertsUnavailable(PayhookError):
    """The alert signals could not be read."""


@dataclass(frozen=True)
class AlertConfig:
    """Windows in seconds."""

    window: float = DEFAULT_WINDOW
    retry_window: float = DEFAULT_RETRY_WINDOW
    retry_threshold: int = DEFAULT_RETRY_THRESHOLD
    outbox_sla: float = 300.0

    @classmethod
    def from_settings(cls, settings: Settings) -> AlertConfig:
        """Read the `PAYHOOK_ALERT_*` variables; a bad one raises `SettingsError` naming it."""
        extra = settings.extra
        window = DEFAULT_WINDOW
        if "PAYHOOK_ALERT_WINDOW" in extra:
            window = parse_duration("PAYHOOK_ALERT_WINDOW", extra["PAYHOOK_ALERT_WINDOW"])
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
        if window <= 0:
            raise SettingsError("PAYHOOK_ALERT_WINDOW: expected a duration above zero")
        return cls(window, retry_window, threshold, settings.outbox_sla)


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
    conn: psycopg.Connection[Row], redis: Redis, settings: Settings, config: AlertConfig
) -> list[Signal]:
    """Every signal, now. `AlertsUnavailable` when PostgreSQL or Redis does not answer."""
    try:
        row = fetch_one(
            conn, "count_alert_signals", {"window": config.window, "sla": config.outbox_sla}
        )
    except psycopg.Error as exc:
        raise AlertsUnavailable(f"PostgreSQL: {exc}".strip()) from exc
    assert row is not None
    try:
        retries = counters.total(redis, counters.SERIALIZATION_RETRIES, config.retry_window)
        dead_letters = FailedJobRegistry(queue=events_queue(redis, settings)).get_job_count(
            cleanup=False
        )
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
    ]


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
    config = AlertConfig.from_settings(settings)
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
