"""Settings only the ingress reads, from `settings.extra`, checked at start."""

from __future__ import annotations

import math
from dataclasses import dataclass

from payhook.errors import SettingsError
from payhook.settings import Settings, parse_duration

#: Default of `PAYHOOK_INGRESS_RETRY_AFTER`, in seconds.
DEFAULT_RETRY_AFTER = 5


@dataclass(frozen=True)
class IngressConfig:
    #: Seconds a 503 asks the sender to wait (`Retry-After`).
    retry_after: int = DEFAULT_RETRY_AFTER

    @classmethod
    def from_settings(cls, settings: Settings) -> IngressConfig:
        raw = settings.get("PAYHOOK_INGRESS_RETRY_AFTER")
        if raw is None:
            return cls()
        seconds = parse_duration("PAYHOOK_INGRESS_RETRY_AFTER", raw)
        if seconds <= 0:
            raise SettingsError(
                f"PAYHOOK_INGRESS_RETRY_AFTER: expected a duration above zero, got {raw!r}"
            )
        return cls(retry_after=math.ceil(seconds))
