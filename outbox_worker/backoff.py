"""When to try a failed delivery again: exponential backoff with jitter, `Retry-After`."""

from __future__ import annotations

import random
from email.utils import parsedate_to_datetime

#: Largest exponent used, so a huge attempt count cannot overflow a float.
MAX_EXPONENT = 60


def retry_delay(
    attempts: int,
    base: float,
    cap: float,
    *,
    retry_after: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait after the `attempts`-th failed attempt.

    The ceiling doubles from `base` and stops at `cap`; the delay is drawn
    uniformly from the upper half of it ("equal jitter"), so workers that failed
    together spread out while every delay still grows. A receiver's
    `Retry-After` is a floor, itself capped, so a receiver cannot park a row
    for longer than `cap`.
    """
    ceiling = min(cap, base * 2.0 ** min(max(attempts - 1, 0), MAX_EXPONENT))
    delay = (rng or random).uniform(ceiling / 2, ceiling)
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap))
    return delay


def parse_retry_after(value: str | None, now: float) -> float | None:
    """`Retry-After` as seconds from `now` (a Unix time): delta-seconds or an HTTP date."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)
