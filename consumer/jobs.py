"""The RQ job functions a consumer runs. `apply_event` is the only one.

A consumer begins applying a job's event ahead, on its applier thread, as
RQ dequeues the job (`begin`, called by `PayhookWorker`): the transaction's
commit then waits on PostgreSQL while RQ's writes recording the job as
started wait on Redis, at the same time rather than one after the other.
The job function collects the outcome. Nothing depends on the order of the
two: an event committed before RQ recorded its job (the worker killed in
between) is retried from RQ's intermediate list and finds its receipt.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg
import structlog
from rq import get_current_job

from consumer.handler import Runtime, handle
from consumer.transaction import Applied
from payhook.db import cancel_waiting, error_summary
from payhook.errors import DatabaseError, PayhookError, RefusedJob

log = structlog.get_logger(__name__)

#: Outcomes of a job the consumer could not trust or read: each is recorded
#: as a security anomaly, applies nothing, and fails the job into the
#: dead-letter queue without retries.
REFUSED = frozenset({"signature_invalid", "unknown_endpoint", "malformed_job"})

#: Fault point: SIGKILL this process right after the transaction commits,
#: once RQ has recorded the job as started.
FAULT_KILL_AFTER_COMMIT = "consumer_kill_after_commit"

_runtime: Runtime | None = None
#: One thread applies a process's events, one at a time, in the order begun.
_applier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="payhook-applier")
#: The job id and outcome of the event begun ahead, until its job collects it.
_ahead: tuple[str, Future[Applied]] | None = None
#: The applier thread's id, once it has begun an event.
_applier_thread: int | None = None


def install_runtime(runtime: Runtime | None) -> None:
    """Give the job functions of this process their pool and settings."""
    global _runtime
    _runtime = runtime


def begin(job_id: str, envelope: Any) -> None:
    """Begin applying `envelope`, the argument of the `apply_event` job
    `job_id`, on the applier thread; its job function collects the outcome.

    A begun event is applied even if its job function never runs (RQ failed
    to record the job, the worker was stopped): its job, retried, finds the
    receipt. Beginning another job forgets the outcome of one not collected.
    With no runtime installed nothing is begun: the job function fails the job.
    """
    global _ahead
    if _runtime is None:
        _ahead = None
        return
    _ahead = (job_id, _applier.submit(_apply_ahead, _runtime, envelope))


def wait_for_ahead() -> None:
    """Wait until every event begun so far is applied or has failed,
    leaving outcomes to their jobs."""
    _applier.submit(lambda: None).result()


def apply_event(envelope: Any) -> dict[str, Any]:
    """Apply one enqueued event; the result RQ stores is its outcome.

    A refused job fails rather than finishing: it may be an event the ingress
    acknowledged (signed with a secret retired while the ingress could not
    refresh its endpoints, say), and the dead-letter queue keeps its raw
    envelope for an operator, where a finished job's would expire with its
    result. Retrying would only record the same anomaly again.
    """
    runtime = _installed()
    job = get_current_job()
    ahead = _collect(job.id if job is not None else None)
    result = _wait(ahead) if ahead is not None else _apply(runtime, envelope)
    if result.outcome in REFUSED:
        if job is not None:
            job.retries_left = 0
        raise RefusedJob(f"{result.outcome}: recorded as a security anomaly, nothing applied")
    if FAULT_KILL_AFTER_COMMIT in runtime.settings.faults:
        log.warning("fault_kill_after_commit")
        os.kill(os.getpid(), signal.SIGKILL)
    return {"outcome": result.outcome, "order_id": result.order_id, "retries": result.retries}


def _installed() -> Runtime:
    if _runtime is None:
        raise PayhookError("the consumer runtime is not installed in this process")
    return _runtime


def _collect(job_id: str | None) -> Future[Applied] | None:
    """The outcome begun ahead for `job_id`, if it was."""
    global _ahead
    ahead, _ahead = _ahead, None
    if ahead is None or job_id is None or ahead[0] != job_id:
        return None
    return ahead[1]


def _wait(ahead: Future[Applied]) -> Applied:
    """The outcome begun ahead. Interrupted meanwhile (RQ's job timeout, a
    signal), the statement the applier thread waits for is cancelled, as it
    would be on this thread: the job leaves no transaction behind."""
    try:
        return ahead.result()
    except BaseException:
        if not ahead.done() and _applier_thread is not None:
            cancel_waiting(_applier_thread)
        raise


def _apply_ahead(runtime: Runtime, envelope: Any) -> Applied:
    global _applier_thread
    _applier_thread = threading.get_ident()
    return _apply(runtime, envelope)


def _apply(runtime: Runtime, envelope: Any) -> Applied:
    structlog.contextvars.clear_contextvars()
    try:
        result = handle(runtime, envelope)
    except psycopg.Error as exc:
        # What RQ keeps and logs of a failed job: the class and SQLSTATE. The
        # error's own text may quote the event (PostgreSQL's context shows
        # the JSON it could not read), and so would a chained traceback.
        raise DatabaseError(error_summary(exc)) from None
    else:
        log.info("event_applied", outcome=result.outcome, retries=result.retries)
        return result
    finally:
        structlog.contextvars.clear_contextvars()
