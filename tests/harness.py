"""The ingress app in-process over httpx, and a burst consumer to drain what it queued."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import httpx
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
from starlette.applications import Starlette

from consumer.handler import Runtime
from consumer.main import build_worker
from ingress.app import Ingress, create_app
from payhook.db import create_pool
from payhook.settings import Settings
from tests.conftest import REDIS_TEST_URL


@dataclass
class Harness:
    app: Starlette
    client: httpx.AsyncClient
    settings: Settings
    redis: Redis

    @property
    def ingress(self) -> Ingress:
        ingress: Ingress = self.app.state.ingress
        return ingress

    async def post(
        self, endpoint_id: str, body: bytes | AsyncIterable[bytes], headers: dict[str, str]
    ) -> httpx.Response:
        return await self.client.post(f"/webhooks/{endpoint_id}", content=body, headers=headers)

    def jobs(self) -> list[Job]:
        ids = cast(list[bytes], self.redis.lrange(f"rq:queue:{self.settings.queue}", 0, -1))
        return [Job.fetch(i.decode(), self.redis, serializer=JSONSerializer) for i in ids]


@asynccontextmanager
async def running(settings: Settings, **options: Any) -> AsyncIterator[Harness]:
    app = create_app(settings, **options)
    transport = httpx.ASGITransport(app=app)
    redis = Redis.from_url(REDIS_TEST_URL)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://ingress") as client,
    ):
        yield Harness(app, client, settings, redis)
    redis.close()


def drain(settings: Settings) -> list[dict[str, Any]]:
    """Run the consumer's RQ worker in burst mode; the results of the jobs it ran."""
    pool = create_pool(settings, "test", size=2)
    pool.open(wait=True)
    redis = Redis.from_url(settings.redis_url)
    try:
        queued = cast(list[bytes], redis.lrange(f"rq:queue:{settings.queue}", 0, -1))
        ids = [i.decode() for i in queued]
        worker = build_worker(settings, Runtime(settings=settings, pool=pool))
        worker.work(burst=True, with_scheduler=False, logging_level="WARNING")
        jobs = [Job.fetch(i, redis, serializer=JSONSerializer) for i in ids]
        return [cast(dict[str, Any], job.return_value()) for job in jobs]
    finally:
        pool.close()
        redis.close()


def spare_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def refresh(harness: Harness) -> bool:
    return await harness.ingress.refresher.refresh()
