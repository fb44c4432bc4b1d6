"""Wiring of one ingress process: `create_app(settings)` builds the ASGI app.

Building does no I/O. The lifespan loads the endpoint cache (waiting for the
first load, so a ready process has endpoints), starts its refresh, and on
shutdown stops it and closes Redis and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from ingress.config import IngressSettings
from ingress.endpoints import EndpointCache, Loader, PostgresEndpoints, Refresher
from ingress.enqueue import Enqueuer
from ingress.metrics import Metrics
from ingress.routes import ROUTES, WEBHOOK_PREFIX, receive_webhook
from payhook.sealing import Keyring
from payhook.settings import Settings


class Ingress:
    """What the routes use, built once per process."""

    def __init__(self, settings: Settings, load_endpoints: Loader | None = None) -> None:
        self.settings = settings
        self.config = IngressSettings.from_settings(settings)
        self.retry_after = ((b"retry-after", str(self.config.retry_after).encode()),)
        self.metrics = Metrics()
        self.cache = EndpointCache()
        self._postgres: PostgresEndpoints | None = None
        if load_endpoints is None:
            self._postgres = load_endpoints = PostgresEndpoints(
                settings.database_url,
                Keyring.from_settings(settings),
                role=settings.database_role,
                pooled=settings.database_pooler == "transaction",
            )
        self.refresher = Refresher(
            self.cache, load_endpoints, settings.endpoint_refresh, on_result=self._count_refresh
        )
        self.enqueuer = Enqueuer(settings)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresher.refresh()
        self._task = asyncio.create_task(self.refresher.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.enqueuer.close()
        if self._postgres is not None:
            await self._postgres.close()

    def _count_refresh(self, ok: bool) -> None:
        self.metrics.endpoint_refreshes.labels("ok" if ok else "failed").inc()


class IngressApp(Starlette):
    """Starlette, with `POST /webhooks/{endpoint_id}` taken straight to its receiver.

    Starlette's middleware and router wrap every call and every `send` of a
    request in a layer each: 10% of the ingress's CPU per webhook, measured
    with py-spy under wrk. The webhook route skips them; its receiver answers
    an unexpected error with a 500 itself, as Starlette's outermost middleware
    would. Every other request (the probes, another method on a webhook path:
    405, an unknown path: 404) goes through Starlette as before.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            endpoint_id = path[len(WEBHOOK_PREFIX) :]
            if path.startswith(WEBHOOK_PREFIX) and endpoint_id and "/" not in endpoint_id:
                scope["app"] = self
                scope["path_params"] = {"endpoint_id": endpoint_id}
                await receive_webhook(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings, *, load_endpoints: Loader | None = None) -> Starlette:
    """The ingress app; `load_endpoints` replaces the PostgreSQL reader (tests)."""
    ingress = Ingress(settings, load_endpoints)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await ingress.start()
        try:
            yield
        finally:
            await ingress.stop()

    app = IngressApp(routes=ROUTES, lifespan=lifespan)
    app.state.ingress = ingress
    return app
