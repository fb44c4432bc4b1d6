"""The outbox worker's own settings, read from `Settings.extra` and validated once.

| variable | default | meaning |
|---|---|---|
| `PAYHOOK_OUTBOX_LEASE` | 60s | how long a claim holds a row before another worker may take it |
| `PAYHOOK_OUTBOX_BATCH` | 20 | rows claimed per round trip |
| `PAYHOOK_OUTBOX_CONCURRENCY` | 10 | deliveries in flight per worker process |
| `PAYHOOK_OUTBOX_POLL` | 5s | longest idle wait when no notification arrives |
| `PAYHOOK_OUTBOX_TIMEOUT` | 10s | HTTP timeout of one delivery (connect, write, read) |
| `PAYHOOK_OUTBOX_MAX_ATTEMPTS` | 30 | attempts before a row is `dead` |
| `PAYHOOK_OUTBOX_BACKOFF` | 5s | delay before the first retry; doubles each attempt |
| `PAYHOOK_OUTBOX_BACKOFF_MAX` | 1h | longest delay between two attempts, `Retry-After` included |

Where deliveries may go (`PAYHOOK_ALLOW_INSECURE_FULFILMENT`,
`PAYHOOK_FULFILMENT_ALLOW_NETWORKS`) is read by `payhook.destinations`, which
`payhook tenants add` shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from payhook.destinations import DestinationPolicy
from payhook.errors import SettingsError
from payhook.settings import Settings, positive_duration, positive_int

#: Smallest lease, in multiples of the HTTP timeout.
LEASE_PER_TIMEOUT = 3
#: Seconds a claim holds a row.
DEFAULT_LEASE = 60.0
#: Rows claimed per round trip.
DEFAULT_BATCH = 20
#: Deliveries in flight per process.
DEFAULT_CONCURRENCY = 10
#: Seconds of the longest idle wait between two looks at the table.
DEFAULT_POLL = 5.0
#: Seconds an HTTP delivery may wait on connect, write or read.
DEFAULT_TIMEOUT = 10.0
#: Attempts before a row is given up as dead.
DEFAULT_MAX_ATTEMPTS = 30
#: Seconds before the first retry.
DEFAULT_BACKOFF = 5.0
#: Seconds of the longest delay between two attempts.
DEFAULT_BACKOFF_MAX = 3600.0


@dataclass(frozen=True)
class OutboxSettings:
    """How the worker claims, delivers and retries; durations in seconds."""

    lease: float = DEFAULT_LEASE
    batch: int = DEFAULT_BATCH
    concurrency: int = DEFAULT_CONCURRENCY
    poll: float = DEFAULT_POLL
    timeout: float = DEFAULT_TIMEOUT
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff: float = DEFAULT_BACKOFF
    backoff_max: float = DEFAULT_BACKOFF_MAX
    #: Where deliveries may go; by default https to public addresses only.
    destinations: DestinationPolicy = field(default_factory=DestinationPolicy)

    def __post_init__(self) -> None:
        # A delivery (connect, then response, each up to the timeout) must fit in
        # a lease with room to claim and record, or a second worker could take
        # the row over while the first is still sending.
        if self.lease < LEASE_PER_TIMEOUT * self.timeout:
            raise SettingsError(
                f"PAYHOOK_OUTBOX_LEASE: must be at least {LEASE_PER_TIMEOUT} times "
                f"PAYHOOK_OUTBOX_TIMEOUT ({self.timeout:g}s), got {self.lease:g}s"
            )
        if self.backoff_max < self.backoff:
            raise SettingsError(
                f"PAYHOOK_OUTBOX_BACKOFF_MAX: must be at least PAYHOOK_OUTBOX_BACKOFF "
                f"({self.backoff:g}s), got {self.backoff_max:g}s"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> OutboxSettings:
        """Read the `PAYHOOK_OUTBOX_*` variables; a bad one raises `SettingsError` naming it."""
        extra = settings.extra

        def whole(name: str, default: int) -> int:
            return positive_int(name, extra[name]) if name in extra else default

        def seconds(name: str, default: float) -> float:
            return positive_duration(name, extra[name]) if name in extra else default

        return cls(
            lease=seconds("PAYHOOK_OUTBOX_LEASE", DEFAULT_LEASE),
            batch=whole("PAYHOOK_OUTBOX_BATCH", DEFAULT_BATCH),
            concurrency=whole("PAYHOOK_OUTBOX_CONCURRENCY", DEFAULT_CONCURRENCY),
            poll=seconds("PAYHOOK_OUTBOX_POLL", DEFAULT_POLL),
            timeout=seconds("PAYHOOK_OUTBOX_TIMEOUT", DEFAULT_TIMEOUT),
            max_attempts=whole("PAYHOOK_OUTBOX_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS),
            backoff=seconds("PAYHOOK_OUTBOX_BACKOFF", DEFAULT_BACKOFF),
            backoff_max=seconds("PAYHOOK_OUTBOX_BACKOFF_MAX", DEFAULT_BACKOFF_MAX),
            destinations=DestinationPolicy.from_settings(settings),
        )
