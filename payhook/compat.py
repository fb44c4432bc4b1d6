"""What payhook relies on inside other libraries, behind one door.

Each function or class here touches something a library keeps to itself: a
private attribute or method, or a name its own code uses internally and does
not document. Its docstring says what it relies on and why payhook needs it.
For each, `tests/unit/test_compat.py` (and `tests/integration/test_compat.py`
where a real server is needed) fails, naming the library, when an upgrade
changes it, and `pyproject.toml` pins the library below the release that may.
Nowhere else does payhook touch another library's private names: a test
scans the source for it.

Libraries that not every process loads (httpx and httpcore, pgserver,
rq-dashboard) are imported inside the function that needs them, or reached
through its arguments, never at module level: the ingress imports the
kernel and none of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from redis.asyncio.connection import AbstractConnection
from redis.client import Pipeline
from rq import Queue
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.worker import BaseWorker

from payhook.errors import IncompatibleDependency

if TYPE_CHECKING:
    import httpcore
    import httpx
    from flask import Flask

# -- redis-py -----------------------------------------------------------------


def writer_of(connection: AbstractConnection) -> asyncio.StreamWriter | None:
    """The stream writer of a redis.asyncio connection: set by `connect()`,
    None once disconnected (redis-py's `_writer`).

    The ingress's job writer hands a batch to the transport in the same turn
    of the event loop (`ingress.enqueue`); redis-py's own
    `send_packed_command` is a coroutine and would send it a turn later.
    """
    writer: asyncio.StreamWriter | None = connection._writer
    return writer


def pipeline_commands(pipeline: Pipeline) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The commands queued on a pipeline and not yet sent, as `(args, options)`
    (redis-py's `command_stack`, undocumented).

    The ingress records the commands RQ sends to enqueue a job, without I/O,
    to write jobs itself (`ingress.jobs`).
    """
    commands: list[tuple[tuple[Any, ...], dict[str, Any]]] = pipeline.command_stack
    return commands


# -- RQ -----------------------------------------------------------------------


def assume_redis_version(queue: Queue, version: tuple[int, int, int]) -> None:
    """Make `queue` take the Redis server to be `version` without asking it
    (RQ caches the answer in `redis_server_version`, undocumented).

    The ingress records RQ's enqueueing on a client that never connects;
    nothing RQ writes for an event job depends on the version.
    """
    queue.redis_server_version = version


def rq_callback_names(job: Job) -> tuple[str | None, str | None, str | None]:
    """The import paths of the success, failure and stopped callbacks a job's
    hash names, as `restore` read them; None for none (RQ's
    `_success_callback_name`, `_failure_callback_name`, `_stopped_callback_name`).

    A consumer refuses a job naming any callback: RQ would import and call it.
    The public `success_callback` (and the others) would import it to answer.
    """
    return (job._success_callback_name, job._failure_callback_name, job._stopped_callback_name)


def rq_dependency_ids(job: Job) -> list[str]:
    """The ids of the jobs a job's hash says it depends on, as `restore` read
    them (RQ's `_dependency_ids`).

    A consumer refuses a job with dependencies, which payhook never writes.
    The public `dependency_ids` asks Redis for another key instead of reading
    what the hash carries.
    """
    return list(job._dependency_ids)


class JobWithDataHook(Job):
    """An RQ job told when its data (function name, instance, arguments)
    cannot be read: `on_unreadable_data` is called, then the error raised.

    RQ reads the data on first use of `func_name`, `instance`, `args` or
    `kwargs`, in its private `_deserialize_data`, overridden here and nowhere
    else. A consumer fails such a job without retries: reading it again will
    not help.
    """

    def _deserialize_data(self) -> None:
        try:
            super()._deserialize_data()  # type: ignore[no-untyped-call]
        except Exception:
            self.on_unreadable_data()
            raise

    def on_unreadable_data(self) -> None:
        """Called when the job's data cannot be read, before the error is raised."""


def set_worker_state(worker: BaseWorker, state: str) -> None:
    """Set the state RQ's worker reports from `get_state()`, without writing
    it to Redis as `set_state` does (RQ's `_state`).

    A consumer marks itself busy as it begins a job's event ahead of RQ: a
    stop requested meanwhile (`request_stop`) then waits for the job rather
    than interrupting it. RQ's own first write of the job's start records the
    state in Redis; one more write there would wait for another fsync.
    """
    worker._state = state


def record_job_success(
    job: Job,
    value: Any,
    result_ttl: int,
    pipeline: Pipeline,
    *,
    worker_name: str,
    execution_id: str,
    started_at: datetime,
    ended_at: datetime,
) -> None:
    """Queue on `pipeline` what RQ's worker writes for a job that returned
    `value`: its result, status `finished`, its place in the finished
    registry (RQ's `Job._handle_success`), after setting the job's cached
    result and status as the worker does (`_result`, `_status`).

    A consumer finishes a batch of jobs in one atomic write; RQ's public
    `handle_job_success` takes one job and runs its own transaction.
    """
    job._result = value
    job._status = JobStatus.FINISHED
    job._handle_success(
        result_ttl,
        pipeline=pipeline,
        worker_name=worker_name,
        execution_id=execution_id,
        execution_started_at=started_at,
        execution_ended_at=ended_at,
    )


def fail_job(
    worker: BaseWorker,
    job: Job,
    queue: Queue,
    execution: Execution,
    exc_info: tuple[type[BaseException] | None, BaseException | None, TracebackType | None],
) -> None:
    """What RQ's worker does with a job that raised (`_finalize_failure`):
    it records the failure, then retries the job or keeps it in the failed
    registry (the dead-letter queue), as for any job it ran itself.

    A consumer fails the jobs of a batch one by one, each with its own
    exception, outside RQ's `perform_job`.
    """
    worker._finalize_failure(job, queue, execution, exc_info)


# -- httpx and httpcore -------------------------------------------------------


def replace_connection_pool(transport: httpx.HTTPTransport, pool: httpcore.ConnectionPool) -> None:
    """Make `transport` send every request through `pool` (httpx's `_pool`).

    httpx takes no network backend; httpcore's pool does. The outbox worker
    gives its pool a backend that bounds each socket operation by the
    delivery's deadline (`outbox_worker.deadline`).
    """
    transport._pool = pool


# -- pgserver -----------------------------------------------------------------

#: File of a pgserver data directory listing the pids holding its server
#: (pgserver's `DiskList` at `.handle_pids.json`, a JSON list of ints).
PGSERVER_HOLDERS = ".handle_pids.json"


def pgserver_lock(server_class: Any) -> AbstractContextManager[Any]:
    """pgserver's lock between processes, held while it starts, stops, or
    changes the holders of a server (`PostgresServer._lock`).

    `payhook up` drops the holders a killed run left listed, which would keep
    the server running after every later run, under that same lock so that a
    run starting meanwhile is not dropped with them. `server_class` is
    `pgserver.PostgresServer`: pgserver is an optional dependency.
    """
    lock: AbstractContextManager[Any] = server_class._lock
    return lock


def pgserver_holders_file(pgdata: Path) -> Path:
    """The file listing the pids holding the pgserver server of `pgdata`."""
    return pgdata / PGSERVER_HOLDERS


# -- rq-dashboard -------------------------------------------------------------

#: Name of rq-dashboard's blueprint: the prefix of its endpoints.
RQ_DASHBOARD = "rq_dashboard"


def use_rq_dashboard_serializer(serializer: Any) -> None:
    """Make rq-dashboard's views read jobs with `serializer` (its module-level
    `web.config.serializer`, undocumented; pickle unless told).

    payhook's jobs are JSON, and a job hash is never unpickled.
    """
    import rq_dashboard.web as web

    web.config.serializer = serializer


def give_rq_dashboard_connection(app: Flask, redis: Any) -> None:
    """Set rq-dashboard up on `app` (`web.setup_rq_connection`, which reads
    `RQ_DASHBOARD_REDIS_URL`) and make its views use `redis` (they read
    `app.redis_conn`, undocumented).

    The URL in the config is shown in the navbar without credentials; the
    views use payhook's own connection instead of one made from it.
    """
    import rq_dashboard.web as web

    web.setup_rq_connection(app)
    app.redis_conn = redis  # type: ignore[attr-defined]


def replace_rq_dashboard_before_request(app: Flask, hooks: list[Callable[[], Any]]) -> None:
    """Run `hooks` before each of rq-dashboard's views instead of its own
    (`push_rq_connection`, which connects to Redis anew for each request).
    """
    if RQ_DASHBOARD not in app.before_request_funcs:
        raise IncompatibleDependency(
            "rq-dashboard registers no before-request hook of its blueprint: "
            "payhook.compat.replace_rq_dashboard_before_request needs updating"
        )
    app.before_request_funcs[RQ_DASHBOARD] = list(hooks)


def replace_rq_dashboard_views(app: Flask, views: Mapping[str, Callable[..., Any]]) -> None:
    """Serve each of rq-dashboard's endpoints named in `views` (by its
    endpoint name, `rq_dashboard.<view>`) with payhook's function instead:
    the URLs stay, and the pages and JavaScript that call them.

    Endpoint names are not a documented interface; one rq-dashboard no longer
    registers raises rather than leaving its view in place unreplaced.
    """
    missing = sorted(name for name in views if name not in app.view_functions)
    if missing:
        raise IncompatibleDependency(
            f"rq-dashboard no longer registers {', '.join(missing)}: "
            "payhook's dashboard replaces these views by name"
        )
    for name, view in views.items():
        app.view_functions[name] = view
