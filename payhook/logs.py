"""structlog configuration, once per process."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(
    level: str = "INFO", *, json: bool | None = None, stream: TextIO | None = None
) -> None:
    """JSON lines when not on a terminal, the console renderer on one.

    Services log to stdout; commands whose stdout is their answer log to stderr.
    """
    stream = stream or sys.stdout
    if json is None:
        json = not stream.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    # Libraries (rq, uvicorn, psycopg_pool) log through the standard library.
    logging.basicConfig(level=max(logging.getLevelName(level), logging.INFO), stream=sys.stderr)
