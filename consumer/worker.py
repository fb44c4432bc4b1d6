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
import time
from collections.abc import Iterable
from typing import Any, cast

import structlog
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now
from rq.worker import SimpleWorker, WorkerStatus

from consumer.applier import Applier
from payhook import quarantine
from payhook.compat import (
    JobWithDataHook,
    rq_callback_names,
    rq_dependency_ids,
    set_worker_state,
)
from payhook.errors import ForbiddenJob, PayhookError, RefusedJob, UnreadableJob
from payhook.jobhash import check_job_id, data_bound
from payhook.queue import APPLY_EVENT, ReadableJob
from payhook.settings import MAX_JOB_TIMEOUT, Settings

log = structlog.get_logger(__name__)

#: The only job functions a consumer will import and call.
ALLOWED_FUNCTIONS = frozenset({APPLY_EVENT})
#: Fault points: SIGKILL this process once a job's event is committed, before
#: RQ records anything of the job's start, or between its two writes of it
#: (the execution, then the job's status).
FAULT_KILL_BEFORE_STARTED = "consumer_kill_before_started"
FAULT_KILL_BETWEEN_START_WRITES = "consumer_kill_between_start_writes"
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
            return self.applier.finish(self.id, envelope)
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


def read_job(
    connection: Redis, job_class: type[Job], raw_id: bytes, queue: str
) -> tuple[Job | None, str | None]:
    """The job `raw_id` of `queue`, or why it cannot be read: `(job, None)`,
    `(None, reason)`, or `(None, None)` when it has no hash at all (RQ passes
    over a missing job). A lost connection to Redis is raised, never taken
    for an unreadable job."""
    try:
        job_id = check_job_id(raw_id)
        job = job_class.fetch(job_id, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        return None, None
    except (RedisConnectionError, RedisTimeoutError):
        raise
    except UnreadableJob as exc:
        return None, str(exc)
    except Exception as exc:  # a key of another type (WRONGTYPE), or anything RQ raises
        return None, f"RQ could not read it ({exc.__class__.__name__})"
    if job.origin != queue:
        return None, "origin: not this queue"
    return job, None


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
            raw_id = moved[1]
            job, reason = read_job(connection, queue.job_class, raw_id, queue.name)
            if reason is not None:
                queue.quarantine(raw_id, reason, source=queue.intermediate_queue_key, kind="list")
            elif job is not None:
                return job, queue
            # No hash: as RQ, the intermediate list's cleanup drops the id.

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
        """RQ's two writes recording the job as started (its execution, then
        its status) each wait for Redis's fsync: the job's own work, begun
        before both, waits for PostgreSQL's meanwhile."""
        # The job is in hand from here, as RQ's first write will tell Redis:
        # a stop asked for while it is begun waits for it to finish, instead
        # of raising StopRequested in the middle of `begin_ahead`.
        set_worker_state(self, WorkerStatus.BUSY)
        if isinstance(job, PayhookJob):
            job.applier = self.applier
        self.begin_ahead(job)
        super().execute_job(job, queue)

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        if FAULT_KILL_BETWEEN_START_WRITES in self.faults:
            self._killed_by_fault(FAULT_KILL_BETWEEN_START_WRITES)
        super().prepare_job_execution(job, remove_from_intermediate_queue)

    def begin_ahead(self, job: Job) -> None:
        """Begin applying the event of an `apply_event` job on the applier
        (`Applier.begin`); any other job is left to RQ, which refuses or fails it.

        This runs in RQ's loop, outside the job: an error here would stop the
        worker. A job that cannot be begun is left to its job, which applies
        the event itself or fails as RQ records failures.
        """
        if self.applier is None:
            return
        try:
            if job.func_name != APPLY_EVENT:
                return
            job.func  # noqa: B018 - PayhookJob's checks, before anything runs
        except Exception:  # refused, or unreadable: RQ fails the job as usual
            return
        try:
            self.applier.begin(job.id, job.args[0])
        except Exception:
            log.exception("event_not_begun", job_id=job.id)
            return
        if FAULT_KILL_BEFORE_STARTED in self.faults:
            self._killed_by_fault(FAULT_KILL_BEFORE_STARTED)

    def _killed_by_fault(self, fault: str) -> None:
        """Once the event begun is committed (or has failed)."""
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
