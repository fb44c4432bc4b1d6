"""Several jobs per round trip, in RQ's own data model.

RQ takes, starts and finishes one job at a time: with Redis fsyncing every
write (`appendfsync always`) and several round trips per job, its own
bookkeeping bounds a consumer long before PostgreSQL does. A consumer takes
a batch instead, and writes what RQ writes, for the whole batch at once:

    take       one atomic move of up to N ids from the queue into its
               intermediate list (the move RQ makes for one), then one
               pipelined read of their hashes
    started    one write: each job's execution, its entry in the started
               registry and the worker's executions (RQ's `prepare_execution`)
    ...        then one: each job's status `started`, its heartbeat, the
               job kept (no TTL), its id out of the intermediate list
               (RQ's `prepare_job_execution`)
    finished   one: each job's result, status `finished`, entry in the
               finished registry and TTL; its execution removed (RQ's
               `handle_job_success`); the worker's counters

Each write is the commands RQ's own methods queue on a pipeline, sent as one
atomic `EVAL` (`payhook.rediswrites`). Each job is the job RQ would have
written, through RQ's own methods: `rq info`, the dashboard and `payhook
dlq` see batched jobs as any other, and
RQ's recovery of abandoned jobs (an expired execution, an id left in the
intermediate list) works on them unchanged. A job that fails is failed or
retried by RQ's own `handle_job_failure`, one at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus

from payhook.compat import record_job_success
from payhook.errors import UnreadableJob
from payhook.jobhash import check_job_id
from payhook.rediswrites import replay

#: Moves up to ARGV[1] ids from the head of KEYS[1] to the tail of KEYS[2],
#: as RQ's LMOVE does for one: atomically, so none is ever in neither list.
TAKE_SCRIPT = """
local moved = {}
for _ = 1, tonumber(ARGV[1]) do
    local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
    if not id then break end
    moved[#moved + 1] = id
end
return moved
"""


def take_ids(connection: Redis, queue_key: str, intermediate_key: str, limit: int) -> list[bytes]:
    """Up to `limit` ids moved from the queue into its intermediate list; none
    waits: an empty queue gives an empty list."""
    if limit <= 0:
        return []
    moved = connection.eval(TAKE_SCRIPT, 2, queue_key, intermediate_key, limit)
    return cast(list[bytes], moved)


def read_job(
    connection: Redis, job_class: type[Job], raw_id: bytes, queue: str
) -> tuple[Job | None, str | None]:
    """The job `raw_id` of `queue`, or why it cannot be read: `(job, None)`,
    `(None, reason)`, or `(None, None)` when it has no hash at all (RQ passes
    over a missing job). A lost connection to Redis is raised, never taken
    for an unreadable job."""
    return read_jobs(connection, job_class, [raw_id], queue)[0]


def read_jobs(
    connection: Redis, job_class: type[Job], raw_ids: Sequence[bytes], queue: str
) -> list[tuple[Job | None, str | None]]:
    """`read_job` for each of `raw_ids`, their hashes read in one round trip."""
    checked: list[str | UnreadableJob] = []
    with connection.pipeline(transaction=False) as pipe:
        for raw_id in raw_ids:
            try:
                job_id = check_job_id(raw_id)
            except UnreadableJob as exc:
                checked.append(exc)
                continue
            checked.append(job_id)
            pipe.hgetall(job_class.key_for(job_id))
        hashes = iter(pipe.execute(raise_on_error=False))
    return [
        (None, str(job_id))
        if isinstance(job_id, UnreadableJob)
        else _restored(connection, job_class, job_id, next(hashes), queue)
        for job_id in checked
    ]


def _restored(
    connection: Redis, job_class: type[Job], job_id: str, raw: Any, queue: str
) -> tuple[Job | None, str | None]:
    if isinstance(raw, RedisConnectionError | RedisTimeoutError):
        raise raw
    if isinstance(raw, Exception):  # a key of another type (WRONGTYPE)
        return None, f"RQ could not read it ({raw.__class__.__name__})"
    if not raw:
        return None, None
    try:
        job = job_class(job_id, connection=connection, serializer=JSONSerializer)
        job.restore(raw)
    except UnreadableJob as exc:
        return None, str(exc)
    except Exception as exc:  # anything RQ raises
        return None, f"RQ could not read it ({exc.__class__.__name__})"
    if job.origin != queue:
        return None, "origin: not this queue"
    return job, None


def record_started(
    worker: BaseWorker, jobs: Sequence[Job], intermediate_key: str, *, between: Any = None
) -> list[Execution]:
    """RQ's two writes of a job's start, each one round trip for all `jobs`:
    their executions (and the worker busy), then their status. `between`
    is called between the two (a fault point of the tests)."""
    connection = worker.connection
    ttl = max(worker.get_heartbeat_ttl(job) for job in jobs)
    with connection.pipeline() as pipe:
        executions = []
        for job in jobs:
            execution = Execution.create(
                job, worker.get_heartbeat_ttl(job), pipeline=pipe, worker_name=worker.name
            )
            worker.executions[execution.id] = execution
            executions.append(execution)
        worker.set_state(WorkerStatus.BUSY, pipeline=pipe)
        replay(connection, pipe)
    if between is not None:
        between()
    with connection.pipeline() as pipe:
        worker.heartbeat(ttl, pipeline=pipe)
        for job in jobs:
            job.heartbeat(now(), worker.get_heartbeat_ttl(job), pipeline=pipe)
            job.prepare_for_execution(worker.name, pipeline=pipe)
            pipe.persist(job.key)
            pipe.lrem(intermediate_key, 1, job.id)
        replay(connection, pipe)
    return executions


def record_finished(
    worker: BaseWorker,
    finished: Sequence[tuple[Job, Execution, Any]],
    default_result_ttl: int,
) -> None:
    """RQ's write of a successful job, one atomic write for all of `finished`
    (job, its execution, its return value)."""
    if not finished:
        return
    ended = now()
    with worker.connection.pipeline() as pipe:
        worked = timedelta()
        for job, execution, value in finished:
            job.ended_at = ended
            result_ttl = job.get_result_ttl(default_result_ttl)
            record_job_success(
                job,
                value,
                result_ttl,
                pipe,
                worker_name=worker.name,
                execution_id=execution.id,
                started_at=execution.created_at,
                ended_at=ended,
            )
            job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
            worker.cleanup_execution(job, pipeline=pipe, execution=execution)
            if job.started_at is not None:
                worked += ended - job.started_at
        pipe.hincrby(worker.key, "successful_job_count", len(finished))
        pipe.hincrbyfloat(worker.key, "total_working_time", worked.total_seconds())
        replay(worker.connection, pipe)
