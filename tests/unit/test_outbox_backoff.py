"""Retry delays: exponential, jittered, capped; `Retry-After` as a floor."""

from __future__ import annotations

import random
from email.utils import formatdate

from hypothesis import given
from hypothesis import strategies as st

from outbox_worker.backoff import parse_retry_after, retry_delay

NOW = 1_700_000_000.0


@given(
    attempts=st.integers(min_value=1, max_value=10_000),
    base=st.floats(min_value=0.001, max_value=60),
    cap=st.floats(min_value=60, max_value=86_400),
    seed=st.integers(),
)
def test_delay_is_in_the_upper_half_of_the_capped_exponential(
    attempts: int, base: float, cap: float, seed: int
) -> None:
    ceiling = min(cap, base * 2.0 ** min(attempts - 1, 60))
    delay = retry_delay(attempts, base, cap, rng=random.Random(seed))
    assert ceiling / 2 <= delay <= ceiling


def test_delay_doubles_until_the_cap() -> None:
    rng = random.Random(7)
    lowest = [min(retry_delay(n, 1.0, 30.0, rng=rng) for _ in range(200)) for n in range(1, 8)]
    highest = [max(retry_delay(n, 1.0, 30.0, rng=rng) for _ in range(200)) for n in range(1, 8)]
    assert [round(x) for x in highest] == [1, 2, 4, 8, 16, 30, 30]
    assert [round(x * 2) for x in lowest] == [1, 2, 4, 8, 16, 30, 30]


def test_jitter_spreads_workers_that_failed_together() -> None:
    delays = {retry_delay(5, 1.0, 3600.0) for _ in range(50)}
    assert len(delays) > 40


@given(retry_after=st.floats(min_value=0, max_value=10**7), seed=st.integers())
def test_retry_after_is_a_floor_within_the_cap(retry_after: float, seed: int) -> None:
    delay = retry_delay(1, 1.0, 3600.0, retry_after=retry_after, rng=random.Random(seed))
    assert delay >= min(retry_after, 3600.0)
    assert delay <= max(1.0, min(retry_after, 3600.0))


def test_retry_after_in_seconds_and_as_an_http_date() -> None:
    assert parse_retry_after("120", NOW) == 120
    assert parse_retry_after(" 7 ", NOW) == 7
    assert parse_retry_after(formatdate(NOW + 90, usegmt=True), NOW) == 90
    assert parse_retry_after(formatdate(NOW - 90, usegmt=True), NOW) == 0


def test_unreadable_retry_after_is_ignored() -> None:
    for value in (None, "", "soon", "-5", "1.5", "Wed, 99 Foo 2015 07:28:00"):
        assert parse_retry_after(value, NOW) is None
