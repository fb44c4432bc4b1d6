"""An RQ worker that runs only payhook's own job functions.

The JSON serializer keeps pickle out, but RQ would still import whatever
function name a job carries; anyone able to write to Redis could run
`os.system`. `PayhookJob` refuses every function and callback that is not
allowlisted, and every job carrying what payhook never writes (RQ webhooks:
HTTP requests to any address, sent outside the job's timeout; repeats;
arguments other than one envelope; a timeout beyond a day) or whose data
cannot be read; such
a job fails at once, without retries, and its webhooks are never sent.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import structlog
from rq import Queue
from rq.job import Job
from rq.worker import SimpleWorker, WorkerStatus

from consumer import jobs
from payhook.errors import ForbiddenJob
from payhook.queue import APPLY_EVENT
from payhook.settings import MAX_JOB_TIMEOUT

log = structlog.get_logger(__name__)

#: The only job functions a consumer will import and call.
ALLOWED_FUNCTIONS = frozenset({APPLY_EVENT})
#: Fault points: SIGKILL this process once a job's event is committed, before
#: RQ records anything of the job's start, or between its two writes of it
#: (the execution, then the job's status).
FAULT_KILL_BEFORE_STARTED = "consumer_kill_before_started"
FAULT_KILL_BETWEEN_START_WRITES = "consumer_kill_between_start_writes"


class PayhookJob(Job):
    allowed_functions = ALLOWED_FUNCTIONS
    #: What the job carries that payhook never writes, found when it was read.
    _refused: str | None = None

    def restore(self, raw_data: Any) -> Any:
        restored = super().restore(raw_data)
        carried = [
            name
            for name, value in (("webhooks", self.webhooks), ("repeats", self.repeats_left))
            if value
        ]
        if self.timeout is not None and not 0 < self.timeout <= MAX_JOB_TIMEOUT:
            carried.append(f"a timeout of {self.timeout} s")
            self.timeout = None
        self._refused = ", ".join(carried) or None
        self.webhooks = []
        self.repeats_left = None
        return restored

    def _deserialize_data(self) -> None:
        """A job whose data cannot be read fails without retries: reading it
        again will not help, and the dead-letter queue keeps it for an operator."""
        try:
            super()._deserialize_data()  # type: ignore[no-untyped-call]
        except Exception:
            self.retries_left = 0
            raise

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
        return super().func

    @property
    def success_callback(self) -> Any:
        return self._refuse_callback(self._success_callback_name)

    @property
    def failure_callback(self) -> Any:
        return self._refuse_callback(self._failure_callback_name)

    @property
    def stopped_callback(self) -> Any:
        return self._refuse_callback(self._stopped_callback_name)

    def _refuse_callback(self, name: str | None) -> None:
        if name:
            self.retries_left = 0
            raise ForbiddenJob(f"job {self.id} names callback {name!r}; payhook runs none")
        return None


class PayhookQueue(Queue):
    """The events queue as a consumer works it."""

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


class PayhookWorker(SimpleWorker):
    """Runs jobs in its own process (no fork per job), so the pool is reused,
    and begins a job's event on the applier thread before RQ records the job
    as started (`begin_ahead`).

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
    #: Test-only fault points (PAYHOOK_FAULTS).
    faults: frozenset[str] = frozenset()
    #: A signal asked the worker to stop. RQ's loop also ends, quietly, on a
    #: Redis timeout or any error it did not expect: then this stays False.
    stop_requested_by_signal = False

    def request_stop(self, signum: Any, frame: Any) -> None:
        self.stop_requested_by_signal = True
        super().request_stop(signum, frame)  # type: ignore[no-untyped-call]

    def execute_job(self, job: Job, queue: Queue) -> None:
        """RQ's two writes recording the job as started (its execution, then
        its status) each wait for Redis's fsync: the job's own work, begun
        before both, waits for PostgreSQL's meanwhile."""
        # The job is in hand from here, as RQ's first write will tell Redis:
        # a stop asked for while it is begun waits for it to finish, instead
        # of raising StopRequested in the middle of `begin_ahead`.
        self._state = WorkerStatus.BUSY
        self.begin_ahead(job)
        super().execute_job(job, queue)

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        if FAULT_KILL_BETWEEN_START_WRITES in self.faults:
            self._killed_by_fault(FAULT_KILL_BETWEEN_START_WRITES)
        super().prepare_job_execution(job, remove_from_intermediate_queue)

    def begin_ahead(self, job: Job) -> None:
        """Begin applying the event of an `apply_event` job (`jobs.begin`);
        any other job is left to RQ, which refuses or fails it.

        This runs in RQ's loop, outside the job: an error here would stop the
        worker. A job that cannot be begun is left to its job function, which
        applies the event itself or fails the job as RQ records failures.
        """
        try:
            if job.func_name != APPLY_EVENT:
                return
            job.func  # noqa: B018 - PayhookJob's checks, before anything runs
        except Exception:  # refused, or unreadable: RQ fails the job as usual
            return
        try:
            jobs.begin(job.id, job.args[0])
        except Exception:
            log.exception("event_not_begun", job_id=job.id)
            return
        if FAULT_KILL_BEFORE_STARTED in self.faults:
            self._killed_by_fault(FAULT_KILL_BEFORE_STARTED)

    def _killed_by_fault(self, fault: str) -> None:
        """Once the event begun is committed (or has failed)."""
        jobs.wait_for_ahead()
        log.warning("fault_kill", fault=fault)
        os.kill(os.getpid(), signal.SIGKILL)

    @property
    def dequeue_timeout(self) -> int:
        # RQ blocks on an empty queue for worker_ttl - 15 s (405 s by default)
        # and runs maintenance only between blocks; block no longer than the
        # maintenance interval so idle workers still recover abandoned jobs.
        return max(1, min(self.worker_ttl - 15, int(self.maintenance_interval)))

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        timeout = job.timeout if job.timeout and job.timeout > 0 else 180
        return int(timeout) + self.job_grace
