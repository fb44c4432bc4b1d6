"""Configuration from the environment, read once per process.

Every setting is named here with its default. A missing or malformed value
raises `SettingsError` naming the variable, so a process fails at start rather
than at the first event.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from payhook.errors import SettingsError
from payhook.horizon import (
    DAY,
    DEFAULT_RECEIPT_RETENTION,
    REDELIVERY_MARGIN,
    describe,
    minimum_receipt_retention,
    redelivery_windows,
)

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/payhook"
#: The role migration 0011 creates for the processes, subject to row-level security.
DEFAULT_DATABASE_ROLE = "payhook_app"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_QUEUE = "payhook-events"
#: Settings whose values never show in a repr of the settings.
SECRET_SETTINGS = frozenset(
    {
        "PAYHOOK_SECRETS_KEY",
        "PAYHOOK_DATABASE_DIRECT_URL",
        "PAYHOOK_DASHBOARD_PASSWORD",
        "PAYHOOK_REDIS_SENTINEL_PASSWORD",
    }
)
#: What may stand between payhook and PostgreSQL (`PAYHOOK_DATABASE_POOLER`).
POOLERS = ("none", "transaction")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
#: Seconds no duration may exceed: 100 years. Retentions and windows are
#: subtracted from now, by Python and by PostgreSQL; a few million days would
#: reach before year 1 (`OverflowError`) or 4713 BC (`timestamp out of range`)
#: at the first event or run instead of at start.
MAX_DURATION = 36500 * DAY


class Secret(str):
    """A string that never shows itself in a repr or a log line."""

    def __repr__(self) -> str:
        return "Secret('**********')"


def parse_duration(name: str, raw: str) -> float:
    """`"90"`, `"90s"`, `"5m"`, `"400d"` or `"250ms"` as seconds, at most `MAX_DURATION`."""
    match = _DURATION.match(raw)
    if match is None:
        raise SettingsError(f"{name}: expected a duration such as 30s, 5m or 400d, got {raw!r}")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > MAX_DURATION:
        raise SettingsError(
            f"{name}: expected at most {describe(MAX_DURATION)} (100 years), got {raw!r}"
        )
    return seconds


def positive_duration(name: str, raw: str, most: float = MAX_DURATION) -> float:
    """`raw` as seconds above zero and at most `most`; `SettingsError` naming `name` if not."""
    seconds = parse_duration(name, raw)
    if seconds <= 0:
        raise SettingsError(f"{name}: expected a duration above zero, got {raw!r}")
    if seconds > most:
        raise SettingsError(f"{name}: expected at most {describe(most)}, got {raw!r}")
    return seconds


#: Duration settings: attribute, variable and the least value that makes sense
#: (the most, for every duration, is `MAX_DURATION`). Zero would reload the
#: endpoint table in a loop, refuse every webhook with a 503, or delete rows
#: (and with them alerts) as soon as they are written.
DURATIONS: dict[str, tuple[str, float]] = {
    "endpoint_refresh": ("PAYHOOK_ENDPOINT_REFRESH", 0.1),
    "enqueue_timeout": ("PAYHOOK_ENQUEUE_TIMEOUT", 0.01),
    "gateway_timeout": ("PAYHOOK_GATEWAY_TIMEOUT", 0.1),
    "result_ttl": ("PAYHOOK_RESULT_TTL", 1.0),
    "outbox_sla": ("PAYHOOK_OUTBOX_SLA", 1.0),
    "receipt_retention": ("PAYHOOK_RECEIPT_RETENTION", 0.0),  # checked against the horizon
    "outbox_retention": ("PAYHOOK_OUTBOX_RETENTION", 3600.0),
    "exception_retention": ("PAYHOOK_EXCEPTION_RETENTION", 3600.0),
    "anomaly_retention": ("PAYHOOK_ANOMALY_RETENTION", 3600.0),
}


def _seconds(value: float) -> str:
    return f"{value * 1000:g}ms" if value < 1 else describe(value)


#: The longest job timeout, in seconds (a day). A consumer refuses a job
#: carrying a longer one, which payhook never writes: a forged timeout could
#: otherwise make RQ's bookkeeping fail outside the job and stop the worker.
MAX_JOB_TIMEOUT = 86_400
#: Most jobs a consumer takes at once: one transaction holds their locks together.
MAX_CONSUMER_BATCH = 256


@dataclass(frozen=True)
class Settings:
    """Everything a payhook process reads from its environment."""

    database_url: str = DEFAULT_DATABASE_URL
    #: The role every connection but the owner's works as
    #: (`PAYHOOK_DATABASE_ROLE`): row-level security applies to it. Empty:
    #: the role the URL logs in as, which must then be subject to it too.
    database_role: str = DEFAULT_DATABASE_ROLE
    #: `transaction` when `database_url` reaches PostgreSQL through a pooler
    #: in transaction mode (PgBouncer): no server-side prepared statements,
    #: no session options (`PAYHOOK_DATABASE_POOLER`; `none` by default).
    database_pooler: str = "none"
    #: A URL reaching PostgreSQL itself, for what needs a session of its
    #: own past a pooler: migrations, the owner's commands, the outbox
    #: worker's LISTEN (`PAYHOOK_DATABASE_DIRECT_URL`).
    database_direct_url: str | None = None
    redis_url: str = DEFAULT_REDIS_URL
    queue: str = DEFAULT_QUEUE
    #: Environment name of the process, for logs (`PAYHOOK_ENV`).
    env: str = "dev"
    #: Log level name (`PAYHOOK_LOG_LEVEL`).
    log_level: str = "INFO"
    #: Connections per process in the PostgreSQL pool.
    db_pool_size: int = 4
    #: Seconds a consumer job may run before RQ kills it (at most MAX_JOB_TIMEOUT).
    job_timeout: int = 30
    #: Seconds, added to the job timeout, before an abandoned job is retried.
    job_grace: int = 15
    #: Seconds between RQ maintenance passes that requeue abandoned jobs.
    maintenance_interval: int = 30
    #: Most jobs a consumer takes and applies together (at most MAX_CONSUMER_BATCH).
    consumer_batch: int = 16
    #: RQ retries of one event job that raised (database down) or was abandoned
    #: by a killed worker, with these intervals in seconds. The first is 0: an
    #: immediate requeue needs no RQ scheduler, so an abandoned job comes back
    #: even while the scheduler lock of a killed worker has not yet expired.
    job_retry_intervals: tuple[int, ...] = (0, 2, 5, 15, 30, 60, 120, 300, 600)
    #: Seconds RQ keeps a finished job (its envelope, raw body included) and
    #: its result in Redis: memory that grows with the event rate. The receipt
    #: in PostgreSQL is the lasting record; failed jobs are kept apart.
    result_ttl: float = 600.0
    #: In-job retries of a transaction after a serialization failure or deadlock.
    serialization_retries: int = 5
    #: Largest request body the ingress reads, in bytes.
    max_body: int = 256 * 1024
    #: Seconds between refreshes of the ingress endpoint cache.
    endpoint_refresh: float = 2.0
    #: Seconds the ingress waits for Redis before answering 503.
    enqueue_timeout: float = 2.0
    #: Seconds a call to a gateway's API may take (a PayPal certificate, the
    #: GoCardless payment an event links to); then the request is answered
    #: 503, or the job retried.
    gateway_timeout: float = 10.0
    #: Seconds an outbox row may stay undelivered before it alerts.
    outbox_sla: float = 300.0
    #: Seconds a receipt is kept before it moves to the archive; never less
    #: than the longest gateway redelivery window plus a margin (payhook.horizon).
    receipt_retention: float = DEFAULT_RECEIPT_RETENTION
    #: Seconds a delivered outbox row is kept before retention deletes it.
    outbox_retention: float = 30 * 86400.0
    #: Seconds a resolved exception is kept; open exceptions are never deleted.
    exception_retention: float = 400 * 86400.0
    #: Seconds a security anomaly is kept.
    anomaly_retention: float = 400 * 86400.0
    #: Rows one retention transaction moves or deletes.
    retention_batch: int = 500
    #: Fault points a test enables (`PAYHOOK_FAULTS=a,b`); empty in production.
    faults: frozenset[str] = field(default_factory=frozenset)
    #: Everything else under the `PAYHOOK_` prefix, for components that add
    #: their own settings.
    extra: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        """Build settings from a mapping such as `os.environ`."""
        values: dict[str, Any] = {
            "database_url": Secret(environ.get("DATABASE_URL") or DEFAULT_DATABASE_URL),
            "redis_url": Secret(environ.get("REDIS_URL") or DEFAULT_REDIS_URL),
            "queue": environ.get("PAYHOOK_QUEUE") or DEFAULT_QUEUE,
        }
        _check_url("DATABASE_URL", values["database_url"], ("postgresql://", "postgres://"))
        if "PAYHOOK_DATABASE_ROLE" in environ:
            values["database_role"] = _role_name(environ["PAYHOOK_DATABASE_ROLE"])
        pooler = environ.get("PAYHOOK_DATABASE_POOLER", "").strip() or "none"
        if pooler not in POOLERS:
            raise SettingsError(
                f"PAYHOOK_DATABASE_POOLER: expected none or transaction, got {pooler!r}"
            )
        values["database_pooler"] = pooler
        if pooler == "transaction" and values.get("database_role", DEFAULT_DATABASE_ROLE):
            raise SettingsError(
                "PAYHOOK_DATABASE_POOLER=transaction: a pooler passes no role to switch to; "
                "log in as a role that is a member of payhook_app and set "
                "PAYHOOK_DATABASE_ROLE to empty"
            )
        if environ.get("PAYHOOK_DATABASE_DIRECT_URL"):
            direct = Secret(environ["PAYHOOK_DATABASE_DIRECT_URL"])
            _check_url("PAYHOOK_DATABASE_DIRECT_URL", direct, ("postgresql://", "postgres://"))
            values["database_direct_url"] = direct
        _check_url("REDIS_URL", values["redis_url"], ("redis://", "rediss://", "unix://"))
        ints = {
            "db_pool_size": "PAYHOOK_DB_POOL_SIZE",
            "job_timeout": "PAYHOOK_JOB_TIMEOUT",
            "job_grace": "PAYHOOK_JOB_GRACE",
            "maintenance_interval": "PAYHOOK_MAINTENANCE_INTERVAL",
            "consumer_batch": "PAYHOOK_CONSUMER_BATCH",
            "serialization_retries": "PAYHOOK_SERIALIZATION_RETRIES",
            "max_body": "PAYHOOK_MAX_BODY",
            "retention_batch": "PAYHOOK_RETENTION_BATCH",
        }
        for attr, name in ints.items():
            if name in environ:
                values[attr] = positive_int(name, environ[name])
        if values.get("consumer_batch", 0) > MAX_CONSUMER_BATCH:
            raise SettingsError(
                f"PAYHOOK_CONSUMER_BATCH: expected at most {MAX_CONSUMER_BATCH} jobs, "
                f"got {values['consumer_batch']}"
            )
        if values.get("job_timeout", 0) > MAX_JOB_TIMEOUT:
            raise SettingsError(
                f"PAYHOOK_JOB_TIMEOUT: expected at most {MAX_JOB_TIMEOUT} seconds, "
                f"got {values['job_timeout']}"
            )
        for attr, (name, minimum) in DURATIONS.items():
            if name in environ:
                values[attr] = parse_duration(name, environ[name])
                if values[attr] < minimum:
                    raise SettingsError(f"{name}: expected at least {_seconds(minimum)}")
        if "receipt_retention" in values:
            _check_receipt_retention(values["receipt_retention"])
        if "PAYHOOK_JOB_RETRY_INTERVALS" in environ:
            raw = environ["PAYHOOK_JOB_RETRY_INTERVALS"]
            values["job_retry_intervals"] = tuple(
                positive_int("PAYHOOK_JOB_RETRY_INTERVALS", part, minimum=0)
                for part in raw.split(",")
            )
        if "PAYHOOK_LOG_LEVEL" in environ:
            level = environ["PAYHOOK_LOG_LEVEL"].upper()
            if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
                raise SettingsError(
                    f"PAYHOOK_LOG_LEVEL: expected DEBUG, INFO, WARNING or ERROR, got {level!r}"
                )
            values["log_level"] = level
        values["env"] = environ.get("PAYHOOK_ENV", "dev")
        faults = environ.get("PAYHOOK_FAULTS", "")
        values["faults"] = frozenset(f.strip() for f in faults.split(",") if f.strip())
        # A key-encryption key (payhook.sealing), a URL with its password, a
        # password: none may show in a repr of the settings.
        values["extra"] = {
            k: Secret(v) if k in SECRET_SETTINGS else v
            for k, v in environ.items()
            if k.startswith("PAYHOOK_")
        }
        return cls(**values)

    @property
    def direct_url(self) -> str:
        """The URL reaching PostgreSQL itself: `PAYHOOK_DATABASE_DIRECT_URL`,
        else `DATABASE_URL`."""
        return self.database_direct_url or self.database_url

    def get(self, name: str, default: str | None = None) -> str | None:
        """A `PAYHOOK_*` variable not modelled above."""
        return self.extra.get(name, default)


def _check_receipt_retention(seconds: float) -> None:
    minimum, gateway = minimum_receipt_retention()
    if seconds < minimum:
        raise SettingsError(
            f"PAYHOOK_RECEIPT_RETENTION: {describe(seconds)} is shorter than the longest "
            f"gateway redelivery window ({gateway}, {describe(redelivery_windows()[gateway])}) "
            f"plus a {describe(REDELIVERY_MARGIN)} margin; use at least {describe(minimum)}"
        )


def _role_name(raw: str) -> str:
    role = raw.strip()
    if role and not re.fullmatch(r"[a-z_][a-z0-9_$]{0,62}", role):
        raise SettingsError(
            f"PAYHOOK_DATABASE_ROLE: expected a lower-case PostgreSQL role name, got {raw!r}"
        )
    return role


def _check_url(name: str, value: str, schemes: tuple[str, ...]) -> None:
    if not value.startswith(schemes):
        raise SettingsError(f"{name}: expected a URL starting with {' or '.join(schemes)}")


def positive_int(name: str, raw: str, *, minimum: int = 1) -> int:
    """`raw` as a whole number of at least `minimum`; SettingsError naming `name` if not."""
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}: expected a whole number, got {raw!r}") from None
    if value < minimum:
        raise SettingsError(f"{name}: expected a number of at least {minimum}, got {value}")
    return value
