"""Settings only the ingress reads, from `settings.extra`, checked at start."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from payhook.errors import SettingsError
from payhook.settings import Settings, parse_duration, positive_duration, positive_int

#: Default of `PAYHOOK_INGRESS_RETRY_AFTER`, in seconds.
DEFAULT_RETRY_AFTER = 5
#: Default of `PAYHOOK_READ_TIMEOUT`, in seconds.
DEFAULT_READ_TIMEOUT = 10.0
#: Bounds of `PAYHOOK_READ_TIMEOUT`, in seconds. Below one second a single lost
#: segment (TCP's first retransmission waits a second) fails an honest sender;
#: above five minutes the deadline no longer frees anything in time, and every
#: gateway has given up on its own request long before.
READ_TIMEOUT_RANGE = (1.0, 300.0)
#: Default of `PAYHOOK_INGRESS_LIMIT_CONCURRENCY`: connections (or requests in
#: progress) at which uvicorn answers 503. Room for a thousand slow clients
#: held until the read deadline beside the gateways' own; partially read
#: bodies then hold at most this many times `PAYHOOK_MAX_BODY`.
DEFAULT_LIMIT_CONCURRENCY = 2048
#: uvicorn counts the connection asking in the limit: one would refuse everything.
MIN_LIMIT_CONCURRENCY = 2
#: Default of `PAYHOOK_INGRESS_KEEP_ALIVE`, in seconds.
DEFAULT_KEEP_ALIVE = 5
#: Bounds of `PAYHOOK_INGRESS_KEEP_ALIVE`, in seconds: a load balancer in front
#: may keep idle connections for minutes, and wants the ingress to outlast it.
KEEP_ALIVE_RANGE = (1.0, 3600.0)


@dataclass(frozen=True)
class IngressSettings:
    #: Seconds a 503 asks the sender to wait (`Retry-After`).
    retry_after: int = DEFAULT_RETRY_AFTER
    #: Seconds a request may take to arrive whole, head and body, from the
    #: connection (or its first byte, on a kept-alive connection); then 408.
    read_timeout: float = DEFAULT_READ_TIMEOUT
    #: Open connections, or requests in progress, at which uvicorn answers 503.
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY
    #: Seconds an idle connection is kept open between requests.
    keep_alive: int = DEFAULT_KEEP_ALIVE

    @classmethod
    def from_settings(cls, settings: Settings) -> IngressSettings:
        values: dict[str, Any] = {}
        raw = settings.get("PAYHOOK_INGRESS_RETRY_AFTER")
        if raw is not None:
            values["retry_after"] = math.ceil(positive_duration("PAYHOOK_INGRESS_RETRY_AFTER", raw))
        raw = settings.get("PAYHOOK_READ_TIMEOUT")
        if raw is not None:
            values["read_timeout"] = _bounded("PAYHOOK_READ_TIMEOUT", raw, READ_TIMEOUT_RANGE)
        raw = settings.get("PAYHOOK_INGRESS_LIMIT_CONCURRENCY")
        if raw is not None:
            values["limit_concurrency"] = positive_int(
                "PAYHOOK_INGRESS_LIMIT_CONCURRENCY", raw, minimum=MIN_LIMIT_CONCURRENCY
            )
        raw = settings.get("PAYHOOK_INGRESS_KEEP_ALIVE")
        if raw is not None:
            # uvicorn takes whole seconds.
            seconds = _bounded("PAYHOOK_INGRESS_KEEP_ALIVE", raw, KEEP_ALIVE_RANGE)
            values["keep_alive"] = math.ceil(seconds)
        return cls(**values)


def _bounded(name: str, raw: str, bounds: tuple[float, float]) -> float:
    seconds = parse_duration(name, raw)
    low, high = bounds
    if not low <= seconds <= high:
        raise SettingsError(f"{name}: expected {low:g}s to {high:g}s, got {raw!r}")
    return seconds
