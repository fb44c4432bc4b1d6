"""Run the ingress under uvicorn: `payhook ingress --host --port --workers`."""

from __future__ import annotations

import gc
import os

import uvicorn
from starlette.applications import Starlette

from ingress.app import create_app
from ingress.config import IngressSettings
from ingress.memory import map_large_blocks_apart
from ingress.protocol import http_protocol
from payhook.errors import SettingsError
from payhook.logs import configure_logging
from payhook.settings import Settings


def app_from_env() -> Starlette:
    """The factory each uvicorn worker calls: settings from its environment.

    What exists once the app is built (modules, classes, the app) lives as
    long as the process: it is moved out of the garbage collector's reach
    (`gc.freeze`), so that its full collections scan only what requests
    leave behind. Measured under load without it: ten full collections in
    five seconds, each scanning the 60,000 objects that exist from start-up.

    Large blocks are mapped apart (ingress.memory), so that what many slow
    bodies held at once is returned to the system once they are gone.
    """
    settings = Settings.from_env(os.environ)
    configure_logging(settings.log_level)
    map_large_blocks_apart()
    app = create_app(settings)
    gc.collect()
    gc.freeze()
    return app


def run(settings: Settings, host: str, port: int, workers: int = 1) -> int:
    """Serve until stopped; settings are checked here so a bad one fails before binding."""
    config = IngressSettings.from_settings(settings)
    if workers < 1:
        raise SettingsError(f"--workers: expected a number above zero, got {workers}")
    if not 0 <= port <= 65535:
        raise SettingsError(f"--port: expected 0 to 65535, got {port}")
    configure_logging(settings.log_level)
    uvicorn.run(
        "ingress.main:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=settings.log_level.lower(),
        # One structlog line per request is written by the route itself.
        access_log=False,
        server_header=False,
        # Nothing here reads the client's address or scheme, which is all
        # uvicorn's proxy-headers middleware rewrites: 1.5% of a webhook's
        # CPU for nothing, measured with py-spy.
        proxy_headers=False,
        lifespan="on",
        # Every request must arrive whole in time (ingress.protocol), and
        # nothing here speaks WebSocket: an upgrade would leave the protocol.
        http=http_protocol(config.read_timeout),
        ws="none",
        limit_concurrency=config.limit_concurrency,
        timeout_keep_alive=config.keep_alive,
    )
    return 0
