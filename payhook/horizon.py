"""The retention horizon: how long a gateway may redeliver, and what is too old.

A receipt may leave the live table only once no gateway will deliver its
event again, so the receipt retention is never shorter than the longest
redelivery window plus a margin; it then moves to an archive the consumer
still reads. An event whose gateway timestamp is older than the horizon (now
minus the receipt retention) is refused by the consumer: a second guard, for
an event so late that it falls outside everything payhook promises to keep.
The guard needs that timestamp, so the gateways refuse an event payhook acts
on without a readable one as malformed (`payhook.gateways`); only an event of
a type payhook ignores may come without.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from payhook.gateways import GATEWAYS
from payhook.gateways.base import DAY as DAY  # the gateways count their windows in it too


def redelivery_windows() -> dict[str, float]:
    """Seconds after an event during which each gateway may still deliver it,
    as each gateway's module says."""
    return {name: gateway.redelivery_window for name, gateway in GATEWAYS.items()}


#: Seconds added to the longest window: clock skew, a late manual resend, an
#: outage of ours that held events back.
REDELIVERY_MARGIN = 7 * DAY
#: Seconds a receipt stays in the live table unless PAYHOOK_RECEIPT_RETENTION says otherwise.
DEFAULT_RECEIPT_RETENTION = 400 * DAY


def minimum_receipt_retention() -> tuple[float, str]:
    """The shortest acceptable receipt retention in seconds, and the gateway that sets it."""
    windows = redelivery_windows()
    gateway = max(windows, key=windows.__getitem__)
    return windows[gateway] + REDELIVERY_MARGIN, gateway


def receipt_horizon(retention: float, now: datetime | None = None) -> datetime:
    """The oldest gateway timestamp an event may carry and still be applied."""
    return (now or datetime.now(UTC)) - timedelta(seconds=retention)


def beyond_horizon(occurred_at: datetime | None, horizon: datetime) -> bool:
    """True for an event older than the horizon. An event without a timestamp
    cannot be judged and is not; no event payhook acts on comes without one."""
    return occurred_at is not None and occurred_at < horizon


def describe(seconds: float) -> str:
    """`37d`, `36h` or `90s`: a duration as an operator would write it."""
    for unit, size in (("d", DAY), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
