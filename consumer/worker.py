"""An RQ worker that runs only payhook's own job functions.

The JSON serializer keeps pickle out, but RQ would still import whatever
function name a job carries; anyone able to write to Redis could run
`os.system`. `PayhookJob` refuses every function and callback that is not
allowlisted, and every job carrying what payhook never writes (RQ webhooks:
HTTP requests to any address, sent outside the job's timeout; repeats;
arguments other than one envelope; a timeout beyond a day; callbacks,
dependencies, a group or a ttl) or whose data cannot be read; such a job fails at
once, without retries, before anything of it is applied, and its webhooks
are never sent.

A job whose hash RQ itself could not read (`payhook.jobhash`) would stop
the worker inside RQ's dequeue or maintenance, every time it is seen: it is
quarantined instead (`payhook.quarantine`), wherever the worker finds it
(dequeued, in the intermediate list, among the abandoned or due retries),
and the worker goes on with the next job.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable
from functools import partial
from typing import Any, cast

import structlog
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue
from rq.job import Job
from rq.timeouts import JobTimeoutException
from rq.utils import now as rq_now
from rq.worker import SimpleWorker, WorkerStatus

from consumer import batch as batching
from consumer.applier import Applier, result_of
from consumer.batch import read_job, read_jobs, take_ids
from consumer.transaction import Applied
from payhook import quarantine
from payhook.compat import (
    JobWithDataHook,
    fail_job,
    rq_callback_names,
    rq_dependency_ids,
    set_worker_state,
)
from payhook.errors import ForbiddenJob, PayhookError, RefusedJob
from payhook.jobhash import data_bound
from payhook.queue import APPLY_EVENT, ReadableJob
from payhook.settings import MAX_JOB_TIMEOUT, Settings

log = structlog.get_logger(__name__)

#: The only job functions a consumer will import and call.
ALLOWED_FUNCTIONS = frozenset({APPLY_EVENT})
#: Fault points: SIGKILL this process once a batch is taken (its ids in the
#: intermediate list, nothing begun); once its events are committed, before
#: anything of the jobs' start is recorded, between the two writes of it (the
#: executions, then the jobs' status), or once both are written.
FAULT_KILL_AFTER_TAKE = "consumer_kill_after_take"
FAULT_KILL_BEFORE_STARTED = "consumer_kill_before_started"
FAULT_KILL_BETWEEN_START_WRITES = "consumer_kill_between_start_writes"
FAULT_KILL_AFTER_COMMIT = "consumer_kill_after_commit"
#: Characters of a quarantined job's id in its log line.
MAX_LOGGED_ID = 200


class PayhookJob(ReadableJob, JobWithDataHook):
    allowed_functions = ALLOWED_FUNCTIONS
    #: Applies the job's event: its worker's, given to each job it runs.
    applier: Applier | None = None
    #: What the job carries that payhook never writes, found when it was read.
    _refused: str | None = None

    def restore(self, raw_data: Any) -> Any:
        restored = super().restore(raw_data)
        callbacks = rq_callback_names(self)
        carried = [
            name
            for name, value in (
                ("webhooks", self.webhooks),
                ("repeats", self.repeats_left),
                ("callbacks", any(callbacks)),
                ("dependencies", rq_dependency_ids(self)),
                ("a group", self.group_id),
                # A ttl would let an accepted event's job expire while it waits.
                ("a ttl", self.ttl is not None and self.ttl >= 0),
            )
            if value
        ]
        if self.timeout is not None and not 0 < self.timeout <= MAX_JOB_TIMEOUT:
            carried.append(f"a timeout of {self.timeout} s")
            self.timeout = None
        self._refused = ", ".join(carried) or None
        self.webhooks = []
        self.repeats_left = None
        return restored

    def on_unreadable_data(self) -> None:
        """A job whose data cannot be read fails without retries: reading it
        again will not help, and the dead-letter queue keeps it for an operator."""
        self.retries_left = 0

    def send_webhooks(self, status: Any, *, exc_string: str | None = None) -> None:
        """Never: payhook's jobs have no webhooks, and a forged one must not
        make a consumer send requests (or hang on them)."""

    @property
    def func(self) -> Any:
        name = self.func_name
        if self._refused is not None:
            self.retries_left = 0
            raise ForbiddenJob(f"job {self.id} carries {self._refused}, which payhook never writes")
        if (
            not isinstance(name, str)
            or name not in self.allowed_functions
            or self.instance is not None
        ):
            self.retries_left = 0
            raise ForbiddenJob(f"job {self.id} names {name!r}, which payhook does not run")
        args, kwargs = self.args, self.kwargs
        if not isinstance(args, list | tuple) or len(args) != 1 or kwargs:
            self.retries_left = 0
            raise ForbiddenJob(f"job {self.id} has arguments payhook never writes")
        if name == APPLY_EVENT:
            return self._apply_event
        return super().func

    def _apply_event(self, envelope: Any) -> dict[str, Any]:
        """What RQ runs for `consumer.jobs.apply_event`: the worker's applier
        finishes the event it began, or applies it now."""
        if self.applier is None:
            raise PayhookError(f"job {self.id} runs only in a payhook consumer, on its Applier")
        try:
            return self.applier.finish(envelope)
        except RefusedJob:
            self.retries_left = 0  # retrying would only record the anomaly again
            raise

    @property
    def success_callback(self) -> Any:
        return self._refuse_callback(rq_callback_names(self)[0])

    @property
    def failure_callback(self) -> Any:
        return self._refuse_callback(rq_callback_names(self)[1])

    @property
    def stopped_callback(self) -> Any:
        return self._refuse_callback(rq_callback_names(self)[2])

    def _refuse_callback(self, name: str | None) -> None:
        if name:
            self.retries_left = 0
            raise ForbiddenJob(f"job {self.id} names callback {name!r}; payhook runs none")
        return None


def job_class_for(settings: Settings) -> type[PayhookJob]:
    """`PayhookJob`, bounding job data by `settings.max_body`."""
    bound = data_bound(settings.max_body)
    if bound == PayhookJob.max_data:
        return PayhookJob
    return type("PayhookJob", (PayhookJob,), {"max_data": bound})


class PayhookQueue(Queue):
    """The events queue as a consumer works it: a job that cannot be read is
    quarantined as it is dequeued, and the next one taken."""

    #: Seconds the registry-cleaning lock lives. RQ's is 899 s: a worker
    #: killed while cleaning would stop every worker from recovering abandoned
    #: jobs for 15 minutes. Cleaning takes well under a second; if the lock
    #: expires during a long one, a second cleaner repeats idempotent work.
    maintenance_lock_ttl = 60

    def acquire_maintenance_lock(self) -> bool:
        return bool(
            self.connection.set(
                self.registry_cleaning_key, 1, nx=True, ex=self.maintenance_lock_ttl
            )
        )

    @classmethod
    def dequeue_any(  # type: ignore[override]
        cls, queues: Iterable[Queue], timeout: int | None, connection: Redis, **kwargs: Any
    ) -> tuple[Job, Queue] | None:
        """RQ's dequeue of one queue (an atomic move of the id into the
        intermediate list), where a job that cannot be read is quarantined
        instead of raised: RQ would raise it out of the worker's loop."""
        ordered = list(queues)
        if len(ordered) != 1 or not isinstance(ordered[0], PayhookQueue):
            return super().dequeue_any(ordered, timeout, connection, **kwargs)
        queue = ordered[0]
        while True:
            moved = cls.lmove(connection, queue.key, timeout)
            if moved is None:
                return None
            readable = queue.readable([moved[1]])
            if readable:
                return readable[0], queue

    def take(self, limit: int) -> list[Job]:
        """Up to `limit` more jobs, moved at once into the intermediate list
        (`consumer.batch`), without waiting; the unreadable ones quarantined."""
        return self.readable(
            take_ids(self.connection, self.key, self.intermediate_queue_key, limit)
        )

    def readable(self, raw_ids: list[bytes]) -> list[Job]:
        """The jobs of `raw_ids`, just moved into the intermediate list, read
        in one round trip; those that cannot be read are quarantined."""
        jobs = []
        for raw_id, (job, reason) in zip(
            raw_ids, read_jobs(self.connection, self.job_class, raw_ids, self.name), strict=True
        ):
            if reason is not None:
                self.quarantine(raw_id, reason, source=self.intermediate_queue_key, kind="list")
            elif job is not None:
                jobs.append(job)
            # No hash: as RQ, the intermediate list's cleanup drops the id.
        return jobs

    def quarantine(
        self,
        raw_id: bytes,
        reason: str,
        *,
        source: str | bytes,
        kind: str,
        member: bytes | None = None,
    ) -> None:
        quarantine.move(
            self.connection, self.name, raw_id, reason, source=source, kind=kind, member=member
        )
        log.error(
            "job_quarantined",
            # Bounded: a forged id may be of any length.
            job_id=quarantine.printable(raw_id)[:MAX_LOGGED_ID],
            reason=reason,
            found_in=source if isinstance(source, str) else quarantine.printable(source),
        )

    def sweep(self) -> int:
        """Quarantine every unreadable job where RQ's maintenance or scheduler
        would read it: the intermediate list, the started registry's expired
        entries (abandoned jobs) and the scheduled registry's due ones
        (retries). How many were quarantined."""
        found = 0
        connection = self.connection
        for raw_id in cast(list[bytes], connection.lrange(self.intermediate_queue_key, 0, -1)):
            _, reason = read_job(connection, self.job_class, raw_id, self.name)
            if reason is not None:
                self.quarantine(raw_id, reason, source=self.intermediate_queue_key, kind="list")
                found += 1
        now = time.time()
        for key, composite in (
            (self.started_job_registry.key, True),
            (self.scheduled_job_registry.key, False),
        ):
            for member in cast(list[bytes], connection.zrangebyscore(key, 0, now)):
                raw_id = member.split(b":", 1)[0] if composite else member
                _, reason = read_job(connection, self.job_class, raw_id, self.name)
                if reason is not None:
                    self.quarantine(raw_id, reason, source=key, kind="zset", member=member)
                    found += 1
        return found


class PayhookWorker(SimpleWorker):
    """Runs jobs in its own process (no fork per job), so the pool is reused,
    a batch at a time (`consumer.batch`): it takes up to `batch_size` jobs
    at once and begins their events on the applier thread before recording
    them as started.

    A batch is what is waiting, never more: under light load a job is
    taken as it comes, alone, with no wait for company.

    An abandoned job (worker SIGKILLed) is retried once its execution entry
    expires: job timeout + `job_grace` seconds after it started, found by the
    next maintenance pass of any worker. One killed before RQ marked it
    started is retried from RQ's intermediate list: a minute after a
    maintenance pass first saw it there, and, if RQ had recorded its
    execution, once that entry has expired (RQ drops it without a retry).
    """

    job_class = PayhookJob
    queue_class = PayhookQueue
    job_grace = 15
    #: Most jobs taken, started, applied and finished together.
    batch_size = 1
    #: Applies the events of the jobs this worker runs (`consumer.main` gives it).
    applier: Applier | None = None
    #: Test-only fault points (PAYHOOK_FAULTS).
    faults: frozenset[str] = frozenset()
    #: A signal asked the worker to stop. RQ's loop also ends, quietly, on a
    #: Redis timeout or any error it did not expect: then this stays False.
    stop_requested_by_signal = False

    def request_stop(self, signum: Any, frame: Any) -> None:
        self.stop_requested_by_signal = True
        super().request_stop(signum, frame)  # type: ignore[no-untyped-call]

    def unsubscribe(self) -> None:
        """Stop listening for RQ's worker commands without waiting out the
        listener's 60 s read.

        RQ unsubscribes first and stops the listener thread after: the thread,
        woken by the reply, goes back to wait up to 60 s for a subscription,
        and redis-py 8.2's `stop()` waits for it, so a stopping worker hung
        for a minute. Here the thread is told to stop first; the reply to
        UNSUBSCRIBE then wakes it, it sees the flag and closes its connection.
        """
        thread, pubsub = self.pubsub_thread, self.pubsub
        if thread is None or pubsub is None:
            return
        thread.stop(timeout=0)
        pubsub.unsubscribe()
        thread.join(timeout=5)
        pubsub.close()

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Run `job` and up to `batch_size` - 1 more jobs waiting behind it:
        the `apply_event` jobs as one batch, any other as RQ runs it (which
        refuses or fails it)."""
        # The jobs are in hand from here, as the first write of their start
        # will tell Redis: a stop asked for meanwhile waits for them to
        # finish, instead of raising StopRequested in the middle of a batch.
        set_worker_state(self, WorkerStatus.BUSY)
        jobs = [job]
        if self.batch_size > 1 and isinstance(queue, PayhookQueue):
            jobs += queue.take(self.batch_size - 1)
        if FAULT_KILL_AFTER_TAKE in self.faults:
            self._killed_by_fault(FAULT_KILL_AFTER_TAKE)
        batch: list[Job] = []
        alone: list[Job] = []
        for taken in jobs:
            (batch if self._batchable(taken) else alone).append(taken)
        if batch:
            self.execute_batch(batch, queue)
        for taken in alone:
            self.execute_alone(taken, queue)

    def execute_alone(self, job: Job, queue: Queue) -> None:
        """Run one job as RQ runs it: its function (`PayhookJob.func`)
        refuses it, fails it, or applies its event on this thread."""
        if isinstance(job, PayhookJob):
            job.applier = self.applier
        super().execute_job(job, queue)

    def _batchable(self, job: Job) -> bool:
        """An `apply_event` job that passes PayhookJob's checks, on a worker
        that applies events."""
        if self.applier is None or not isinstance(job, PayhookJob):
            return False
        try:
            return job.func_name == APPLY_EVENT and job.func is not None
        except Exception:  # refused, or unreadable: RQ fails the job as usual
            return False

    def execute_batch(self, jobs: list[Job], queue: Queue) -> None:
        """Begin the jobs' events, record the jobs as started, collect each
        outcome, then record the successes as finished in one write and fail
        the rest as RQ fails a job (retried, or to the dead-letter queue)."""
        assert self.applier is not None
        try:
            begun = self.applier.begin([job.args[0] for job in jobs])
        except Exception:
            # This runs in RQ's loop, outside any job: an error here would
            # stop the worker. Each job applies its own event instead.
            log.exception("batch_not_begun", jobs=len(jobs))
            for job in jobs:
                self.execute_alone(job, queue)
            return
        if FAULT_KILL_BEFORE_STARTED in self.faults:
            self._killed_by_fault(FAULT_KILL_BEFORE_STARTED)
        between = None
        if FAULT_KILL_BETWEEN_START_WRITES in self.faults:
            between = partial(self._killed_by_fault, FAULT_KILL_BETWEEN_START_WRITES)
        executions = batching.record_started(
            self, jobs, queue.intermediate_queue_key, between=between
        )
        timeout = min(job.timeout or self.queue_class.DEFAULT_TIMEOUT for job in jobs)
        try:
            with self.death_penalty_class(timeout, JobTimeoutException, job_id=jobs[0].id):
                results: list[Applied | Exception] = self.applier.collect(begun)
        except Exception as exc:  # the batch's timeout: every job of it failed
            results = [exc] * len(jobs)
        if FAULT_KILL_AFTER_COMMIT in self.faults:
            self._killed_by_fault(FAULT_KILL_AFTER_COMMIT)
        finished = []
        for job, execution, result in zip(jobs, executions, results, strict=True):
            try:
                if isinstance(result, Exception):
                    raise result
                finished.append((job, execution, result_of(result)))
            except RefusedJob:
                job.retries_left = 0  # retrying would only record the anomaly again
                fail_job(self, job, queue, execution, sys.exc_info())
            except Exception:
                fail_job(self, job, queue, execution, sys.exc_info())
        batching.record_finished(self, finished, self.default_result_ttl)

    def _killed_by_fault(self, fault: str) -> None:
        """Once the events begun are committed (or have failed)."""
        if self.applier is not None:
            self.applier.wait()
        log.warning("fault_kill", fault=fault)
        os.kill(os.getpid(), signal.SIGKILL)

    def run_maintenance_tasks(self) -> None:
        """RQ's maintenance, after quarantining what it could not read. An
        error in it is logged and the worker goes on: the next pass tries again."""
        try:
            for queue in self.queues:
                if isinstance(queue, PayhookQueue):
                    queue.sweep()
            super().run_maintenance_tasks()  # type: ignore[no-untyped-call]
        except (RedisConnectionError, RedisTimeoutError):
            raise
        except Exception:
            log.exception("maintenance_failed", worker=self.name)
            self.last_cleaned_at = rq_now()  # type: ignore[assignment]  # next pass at the interval

    @property
    def dequeue_timeout(self) -> int:
        # RQ blocks on an empty queue for worker_ttl - 15 s (405 s by default)
        # and runs maintenance only between blocks; block no longer than the
        # maintenance interval so idle workers still recover abandoned jobs.
        return max(1, min(self.worker_ttl - 15, int(self.maintenance_interval)))

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        timeout = job.timeout if job.timeout and job.timeout > 0 else 180
        return int(timeout) + self.job_grace
