"""The endpoint cache: last good copy on failure, secrets never shown."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from ingress.endpoints import EndpointCache, Refresher
from payhook.endpoints import Endpoint
from payhook.sealing import MissingKey

ONE = Endpoint("e1", "t1", "standard", ("whsec_c2VjcmV0",))
TWO = Endpoint("e2", "t2", "stripe", ("whsec_stripe",))


class Loader:
    def __init__(self, *results: list[Endpoint] | Exception | None) -> None:
        self.results = list(results)
        self.calls = 0

    async def __call__(self) -> list[Endpoint] | None:
        self.calls += 1
        result = self.results.pop(0) if len(self.results) > 1 else self.results[0]
        if isinstance(result, Exception):
            raise result
        return result


def test_cache_is_not_loaded_until_a_refresh_succeeds() -> None:
    cache = EndpointCache()
    refresher = Refresher(cache, Loader(psycopg.OperationalError("down"), [ONE]), 1.0)
    assert not asyncio.run(refresher.refresh())
    assert not cache.loaded and cache.get("e1") is None and cache.age() is None
    assert asyncio.run(refresher.refresh())
    assert cache.loaded and cache.get("e1") == ONE


def test_failed_refresh_keeps_the_last_good_copy() -> None:
    cache = EndpointCache()
    results: list[bool] = []
    loader = Loader([ONE, TWO], OSError("connection refused"), TimeoutError(), [TWO])
    refresher = Refresher(cache, loader, 1.0, on_result=results.append)
    for _ in range(3):
        asyncio.run(refresher.refresh())
        assert cache.get("e1") == ONE and cache.get("e2") == TWO
    asyncio.run(refresher.refresh())
    assert cache.get("e1") is None and cache.get("e2") == TWO
    assert results == [True, False, False, True]


def test_run_refreshes_every_interval_until_cancelled() -> None:
    loader = Loader([ONE])

    async def scenario() -> None:
        task = asyncio.create_task(Refresher(EndpointCache(), loader, 0.001).run())
        while loader.calls < 3:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert loader.calls >= 3


def test_an_unexpected_error_is_a_failed_refresh_and_the_refreshing_goes_on() -> None:
    """Not only the database's errors: a refresh task that died would keep a
    retired secret verifying for good."""
    results: list[bool] = []
    loader = Loader([ONE], KeyError("secrets"), [TWO])
    cache = EndpointCache()

    async def scenario() -> None:
        refresher = Refresher(cache, loader, 0.001, on_result=results.append)
        task = asyncio.create_task(refresher.run())
        while loader.calls < 3:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert results[:3] == [True, False, True]
    assert cache.get("e2") == TWO


def test_secrets_never_appear_in_a_repr() -> None:
    assert "whsec" not in repr(ONE) and "e1" in repr(ONE)


def test_an_unchanged_table_keeps_the_copy_and_counts_as_fresh() -> None:
    cache = EndpointCache()
    refresher = Refresher(cache, Loader(None, [ONE], None), 1.0)
    assert asyncio.run(refresher.refresh())
    assert not cache.loaded, "nothing read yet: still not loaded"
    assert asyncio.run(refresher.refresh())
    loaded_at = cache.refreshed_at
    assert asyncio.run(refresher.refresh())
    assert cache.get("e1") == ONE
    assert cache.refreshed_at is not None and loaded_at is not None
    assert cache.refreshed_at >= loaded_at


def test_a_missing_key_stops_the_first_load_and_later_keeps_the_copy() -> None:
    """Sealed secrets and no key: the ingress does not start (the lifespan's
    first refresh raises, naming the setting); once running, the last copy serves."""
    first = Refresher(EndpointCache(), Loader(MissingKey()), 1.0)
    with pytest.raises(MissingKey, match="PAYHOOK_SECRETS_KEY"):
        asyncio.run(first.refresh())
    cache = EndpointCache()
    later = Refresher(cache, Loader([ONE], MissingKey()), 1.0)
    assert asyncio.run(later.refresh())
    assert not asyncio.run(later.refresh())
    assert cache.get("e1") == ONE
