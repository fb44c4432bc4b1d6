"""The object that applies a consumer's events: one per worker process.

One job, in one direction:

    PayhookWorker.execute_job      RQ handed the worker a job it could read
      -> Applier.begin             the event starts on the applier thread...
    RQ records the job as started  ...while RQ's two writes wait on Redis
      -> PayhookJob.func           RQ runs the job: `Applier.finish`
      -> Applier.finish            collects the outcome begun
           consumer.handler.handle        verify, read, then one call of
           consumer.transaction           payhook.apply_event_v2 on the server
           consumer.replay.replay_parked  events that waited for this one

The transaction's commit waits on PostgreSQL while RQ's writes recording the
job as started wait on Redis, at the same time rather than one after the
other. Nothing depends on the order of the two: an event committed before RQ
recorded its job (the worker killed in between) is retried from RQ's
intermediate list and finds its receipt. A job the worker did not begin
(`finish` with nothing begun for it) is applied on the job's own thread.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg
import structlog

from consumer.handler import Runtime, handle
from consumer.transaction import Applied
from payhook.db import cancel_waiting, error_summary
from payhook.errors import DatabaseError, RefusedJob
from payhook.outcomes import REFUSED_OUTCOMES

log = structlog.get_logger(__name__)

#: Fault point: SIGKILL this process right after the transaction commits,
#: once RQ has recorded the job as started.
FAULT_KILL_AFTER_COMMIT = "consumer_kill_after_commit"


class Applier:
    """Applies events with `runtime`, one at a time, on a thread of its own."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="payhook-applier")
        #: The job id and outcome of the event begun, until its job collects it.
        self._ahead: tuple[str, Future[Applied]] | None = None
        #: The applier thread's id, once it has begun an event.
        self._thread_id: int | None = None

    def begin(self, job_id: str, envelope: Any) -> None:
        """Begin applying `envelope`, the argument of job `job_id`; `finish`
        collects the outcome.

        A begun event is applied even if its job never runs (RQ failed to
        record the job, the worker was stopped): the job, retried, finds the
        receipt. Beginning another job forgets the outcome of one not collected.
        """
        self._ahead = (job_id, self._thread.submit(self._apply_ahead, envelope))

    def finish(self, job_id: str | None, envelope: Any) -> dict[str, Any]:
        """What RQ runs as job `job_id`: the outcome of its event, begun or
        applied now; the result RQ stores.

        A refused job fails rather than finishing: it may be an event the
        ingress acknowledged (signed with a secret retired while the ingress
        could not refresh its endpoints, say), and the dead-letter queue keeps
        its raw envelope for an operator, where a finished job's would expire
        with its result. RQ retries it no more (`PayhookJob`).
        """
        ahead = self._collect(job_id)
        result = self._wait(ahead) if ahead is not None else self.apply(envelope)
        if result.outcome in REFUSED_OUTCOMES:
            raise RefusedJob(f"{result.outcome}: recorded as a security anomaly, nothing applied")
        if FAULT_KILL_AFTER_COMMIT in self.runtime.settings.faults:
            log.warning("fault_kill_after_commit")
            os.kill(os.getpid(), signal.SIGKILL)
        return {"outcome": result.outcome, "order_id": result.order_id, "retries": result.retries}

    def apply(self, envelope: Any) -> Applied:
        """Apply one envelope on this thread: one canonical log line.

        PostgreSQL's errors leave as their class and SQLSTATE: their text may
        quote the event (PostgreSQL's context shows the JSON it could not
        read), and so would a chained traceback, in RQ's failure info and logs.
        """
        structlog.contextvars.clear_contextvars()
        try:
            result = handle(self.runtime, envelope)
        except psycopg.Error as exc:
            raise DatabaseError(error_summary(exc)) from None
        else:
            log.info("event_applied", outcome=result.outcome, retries=result.retries)
            return result
        finally:
            structlog.contextvars.clear_contextvars()

    def wait(self) -> None:
        """Until every event begun so far is applied or has failed, leaving
        outcomes to their jobs."""
        self._thread.submit(lambda: None).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def _collect(self, job_id: str | None) -> Future[Applied] | None:
        """The outcome begun for `job_id`, if it was."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or job_id is None or ahead[0] != job_id:
            return None
        return ahead[1]

    def _wait(self, ahead: Future[Applied]) -> Applied:
        """The outcome begun. Interrupted meanwhile (RQ's job timeout, a
        signal), the statement the applier thread waits for is cancelled, as
        it would be on this thread: the job leaves no transaction behind."""
        try:
            return ahead.result()
        except BaseException:
            if not ahead.done() and self._thread_id is not None:
                cancel_waiting(self._thread_id)
            raise

    def _apply_ahead(self, envelope: Any) -> Applied:
        self._thread_id = threading.get_ident()
        return self.apply(envelope)
