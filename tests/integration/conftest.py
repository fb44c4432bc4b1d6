"""Fixtures of the integration tests that drive the ingress in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis import Redis

from payhook.settings import Settings
from tests.conftest import test_settings
from tests.factories import Factory
from tests.harness import Harness, running


@pytest.fixture
def ingress_settings(database: str, redis_conn: Redis) -> Settings:
    # Refreshes happen when a test asks for them, never on a timer.
    return test_settings(database, PAYHOOK_ENDPOINT_REFRESH="1h")


@pytest.fixture
async def harness(ingress_settings: Settings, factory: Factory) -> AsyncIterator[Harness]:
    async with running(ingress_settings) as harness:
        yield harness
