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
import tempfile
import warnings
from pathlib import Path

import pytest
from redis import Redis
from redis.asyncio.connection import ConnectionPool
from rq import Queue
from rq.exceptions import StopRequested
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
