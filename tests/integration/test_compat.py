"""Contracts of `payhook.compat` that need a real server: Redis, or pgserver's PostgreSQL.

As in `tests/unit/test_compat.py`, a failure names the library whose
internals changed: adapt `payhook/compat.py` before raising its pin.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from redis import Redis
from redis.asyncio.connection import ConnectionPool
from rq import Queue
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker, WorkerStatus

from payhook import compat
from tests.conftest import REDIS_TEST_URL
from tests.unit.test_compat import changed

#: RESP for `PING`.
PING = b"*1\r\n$4\r\nPING\r\n"


def test_redis_async_connection_writes_through_its_stream_writer(redis_conn: Redis) -> None:
    async def ping_through_the_writer() -> None:
        connection = ConnectionPool.from_url(REDIS_TEST_URL).make_connection()
        await connection.connect()
        try:
            writer = compat.writer_of(connection)
            assert isinstance(writer, asyncio.StreamWriter), changed(
                "redis", "`_writer` of a connected connection (no longer a StreamWriter)"
            )
            writer.write(PING)
            assert await connection.read_response() == b"PONG", changed(
                "redis", "what a connection reads after bytes written to `_writer`"
            )
        finally:
            await connection.disconnect()
        assert compat.writer_of(connection) is None, changed(
            "redis", "`_writer` of a disconnected connection (no longer None)"
        )

    asyncio.run(ping_through_the_writer())


def test_rq_worker_stopped_while_its_state_says_busy_waits_for_the_job(redis_conn: Redis) -> None:
    queue = Queue("compat", connection=redis_conn, serializer=JSONSerializer)
    worker = SimpleWorker([queue], connection=redis_conn, serializer=JSONSerializer)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        compat.set_worker_state(worker, WorkerStatus.BUSY)
        assert worker.get_state() == WorkerStatus.BUSY, changed("rq", "the worker's `_state`")
        assert redis_conn.hget(worker.key, "state") is None, "set_worker_state wrote to Redis"
        # Busy: RQ notes the request and lets the job finish.
        worker.request_stop(signal.SIGTERM, None)  # type: ignore[no-untyped-call]
        compat.set_worker_state(worker, WorkerStatus.IDLE)
        with pytest.raises(StopRequested):
            worker.request_stop(signal.SIGTERM, None)  # type: ignore[no-untyped-call]
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def started_job(redis_conn: Redis) -> tuple[Queue, SimpleWorker, Job, Execution]:
    """A job RQ's worker would be running: its execution recorded, started."""
    queue = Queue("compat", connection=redis_conn, serializer=JSONSerializer)
    job = queue.enqueue("bench.consumer_worker.noop", {}, retry=None, failure_ttl=60)
    worker = SimpleWorker([queue], connection=redis_conn, serializer=JSONSerializer)
    worker.register_birth()  # type: ignore[no-untyped-call]
    execution = worker.prepare_execution(job)
    with redis_conn.pipeline() as pipe:
        job.prepare_for_execution(worker.name, pipeline=pipe)
        pipe.execute()
    return queue, worker, job, execution


def test_rq_job_success_is_recorded_into_a_pipeline(redis_conn: Redis) -> None:
    queue, worker, job, execution = started_job(redis_conn)
    with redis_conn.pipeline() as pipe:
        compat.record_job_success(
            job,
            {"outcome": "applied"},
            60,
            pipe,
            worker_name=worker.name,
            execution_id=execution.id,
            started_at=execution.created_at,
            ended_at=execution.created_at,
        )
        assert redis_conn.hget(job.key, "status") == b"started", "written before the pipeline ran"
        pipe.execute()
    done = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert done.get_status() == "finished", changed("rq", "what `_handle_success` writes")
    assert job.id in queue.finished_job_registry, changed("rq", "the finished registry")
    result = done.latest_result()
    assert result is not None and result.return_value == {"outcome": "applied"}, changed(
        "rq", "the result `_handle_success` records from `_result`"
    )


def test_rq_worker_fails_a_job_it_did_not_run_itself(redis_conn: Redis) -> None:
    queue, worker, job, execution = started_job(redis_conn)
    try:
        raise RuntimeError("the event could not be applied")
    except RuntimeError:
        compat.fail_job(worker, job, queue, execution, sys.exc_info())
    failed = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert failed.get_status() == "failed", changed("rq", "what `_finalize_failure` records")
    assert job.id in queue.failed_job_registry, changed("rq", "the failed registry")
    assert job.id not in queue.started_job_registry, changed("rq", "the execution's cleanup")
    result = failed.latest_result()
    assert result is not None and "could not be applied" in (result.exc_string or "")


@pytest.mark.slow
def test_pgserver_lists_its_holders_in_the_file_compat_names() -> None:
    # Not under pytest's temporary folder, which is private (0700): as root,
    # pgserver runs PostgreSQL as another user, who must reach the data folder.
    parent = Path(tempfile.mkdtemp(prefix="payhook-compat-"))
    parent.chmod(0o755)
    pgdata = parent / "pgdata"
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset, as on most servers.
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import get_server

        server = get_server(pgdata, cleanup_mode="delete")
    try:
        listed = json.loads(compat.pgserver_holders_file(pgdata.resolve()).read_text())
        assert listed == [os.getpid()], changed("pgserver", "where it lists a server's holders")
    finally:
        server.cleanup()
        shutil.rmtree(parent, ignore_errors=True)
