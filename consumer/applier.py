"""The object that applies a consumer's events: one per worker process.

A batch of jobs, in one direction:

    PayhookWorker.execute_job      RQ handed the worker a job it could read;
                                   it takes up to N-1 more (consumer.batch)
      -> Applier.begin             their events start on the applier thread...
    RQ's writes of their start     ...while the worker records the jobs as
                                   started, as RQ would, in two round trips
      -> Applier.collect           each job's outcome, or the exception RQ
                                   records for it
           consumer.handler.handle_many   verify and read each, then one
           consumer.transaction           transaction for them all
           consumer.replay.replay_parked  events that waited for these

The transaction's commit waits on PostgreSQL while the writes recording the
jobs as started wait on Redis, at the same time rather than one after the
other. Nothing depends on the order of the two: an event committed before
its job was recorded (the worker killed in between) is retried from RQ's
intermediate list and finds its receipt. A job run by RQ itself (`finish`)
is applied on the job's own thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from consumer.handler import Runtime, handle, handle_many
from consumer.transaction import Applied
from payhook.db import cancel_waiting
from payhook.errors import RefusedJob
from payhook.outcomes import REFUSED_OUTCOMES


class Applier:
    """Applies events with `runtime`, a batch at a time, on a thread of its own."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="payhook-applier")
        #: The applier thread's id, once it has begun a batch.
        self._thread_id: int | None = None

    def begin(self, envelopes: list[Any]) -> Future[list[Applied | Exception]]:
        """Begin applying the arguments of a batch of jobs; `collect` gives
        their outcomes.

        Begun events are applied even if their jobs never finish (RQ's
        writes failed, the worker was stopped): each job, retried, finds its
        receipt.
        """
        return self._thread.submit(self._apply_ahead, envelopes)

    def collect(self, begun: Future[list[Applied | Exception]]) -> list[Applied | Exception]:
        """The outcomes begun, in the order of their envelopes. Interrupted
        meanwhile (RQ's job timeout, a signal), the statement the applier
        thread waits for is cancelled, as it would be on this thread: the
        batch leaves no transaction behind."""
        try:
            return begun.result()
        except BaseException:
            if not begun.done() and self._thread_id is not None:
                cancel_waiting(self._thread_id)
            raise

    def finish(self, envelope: Any) -> dict[str, Any]:
        """What RQ runs for a job it runs itself: the outcome of its event,
        applied now on this thread; the result RQ stores."""
        return result_of(handle(self.runtime, envelope))

    def wait(self) -> None:
        """Until every batch begun so far is applied or has failed."""
        self._thread.submit(lambda: None).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def _apply_ahead(self, envelopes: list[Any]) -> list[Applied | Exception]:
        self._thread_id = threading.get_ident()
        structlog.contextvars.clear_contextvars()
        try:
            return handle_many(self.runtime, envelopes)
        finally:
            structlog.contextvars.clear_contextvars()


def result_of(applied: Applied) -> dict[str, Any]:
    """The result RQ stores for a job whose event was applied.

    A refused job fails rather than finishing (`RefusedJob`): it may be an
    event the ingress acknowledged (signed with a secret retired while the
    ingress could not refresh its endpoints, say), and the dead-letter queue
    keeps its raw envelope for an operator, where a finished job's would
    expire with its result. RQ retries it no more.
    """
    if applied.outcome in REFUSED_OUTCOMES:
        raise RefusedJob(f"{applied.outcome}: recorded as a security anomaly, nothing applied")
    return {"outcome": applied.outcome, "order_id": applied.order_id, "retries": applied.retries}
