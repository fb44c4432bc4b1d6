"""The RQ job functions a consumer runs. `apply_event` is the only one."""

from __future__ import annotations

from typing import Any

import structlog
from rq import get_current_job

from consumer.handler import Runtime, handle
from payhook.errors import PayhookError, RefusedJob

log = structlog.get_logger(__name__)

#: Outcomes of a job the consumer could not trust or read: each is recorded
#: as a security anomaly, applies nothing, and fails the job into the
#: dead-letter queue without retries.
REFUSED = frozenset({"signature_invalid", "unknown_endpoint", "malformed_job"})

_runtime: Runtime | None = None


def install_runtime(runtime: Runtime | None) -> None:
    """Give the job functions of this process their pool and settings."""
    global _runtime
    _runtime = runtime


def apply_event(envelope: Any) -> dict[str, Any]:
    """Apply one enqueued event; the result RQ stores is its outcome.

    A refused job fails rather than finishing: it may be an event the ingress
    acknowledged (signed with a secret retired while the ingress could not
    refresh its endpoints, say), and the dead-letter queue keeps its raw
    envelope for an operator, where a finished job's would expire with its
    result. Retrying would only record the same anomaly again.
    """
    if _runtime is None:
        raise PayhookError("the consumer runtime is not installed in this process")
    structlog.contextvars.clear_contextvars()
    result = handle(_runtime, envelope)
    log.info("event_applied", outcome=result.outcome, retries=result.retries)
    structlog.contextvars.clear_contextvars()
    if result.outcome in REFUSED:
        job = get_current_job()
        if job is not None:
            job.retries_left = 0
        raise RefusedJob(f"{result.outcome}: recorded as a security anomaly, nothing applied")
    return {"outcome": result.outcome, "order_id": result.order_id, "retries": result.retries}
