"""The RQ job functions a consumer runs. `apply_event` is the only one."""

from __future__ import annotations

from typing import Any

import structlog

from consumer.handler import Runtime, handle
from payhook.errors import PayhookError

log = structlog.get_logger(__name__)

_runtime: Runtime | None = None


def install_runtime(runtime: Runtime | None) -> None:
    """Give the job functions of this process their pool and settings."""
    global _runtime
    _runtime = runtime


def apply_event(envelope: Any) -> dict[str, Any]:
    """Apply one enqueued event; the result RQ stores is its outcome."""
    if _runtime is None:
        raise PayhookError("the consumer runtime is not installed in this process")
    structlog.contextvars.clear_contextvars()
    result = handle(_runtime, envelope)
    log.info("event_applied", outcome=result.outcome, retries=result.retries)
    structlog.contextvars.clear_contextvars()
    return {"outcome": result.outcome, "order_id": result.order_id, "retries": result.retries}
