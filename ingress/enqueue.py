"""Put event jobs on the RQ queue with redis.asyncio, without blocking the event loop.

Each job is one `EVAL` of a short Lua script that runs the job's commands
(RQ's own, from `ingress.jobs`) atomically: a job is written whole or not at
all, and never half. One writer task per process sends every job waiting at
that moment in a single write and reads the replies in order (group commit),
so a burst of requests costs one round trip, not one each.

A request waits for its own reply at most `settings.enqueue_timeout` seconds.
A job whose request gave up before it was sent is dropped, never sent late.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from ingress.jobs import Command, JobTemplate
from payhook.envelope import Envelope
from payhook.errors import PayhookError
from payhook.settings import Settings

#: Runs the commands packed in ARGV as one atomic unit: each command is its
#: argument count followed by its arguments. The shebang makes Redis refuse
#: the whole script up front when it is out of memory.
REPLAY_SCRIPT = b"""#!lua
local i = 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  redis.call(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return 1
"""
#: Most jobs sent in one write; the rest go in the next.
MAX_BATCH = 512
#: Connections per process: one for the writer, the others for probes.
REDIS_CONNECTIONS = 4


class EnqueueFailed(PayhookError):
    """Redis did not accept the job."""


def pack_command(args: Sequence[bytes]) -> bytes:
    """One command in the Redis protocol (RESP), as an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n" % len(arg))
        parts.append(arg)
        parts.append(b"\r\n")
    return b"".join(parts)


def pack_job(commands: Sequence[Command]) -> bytes:
    """The `EVAL` that writes one job's commands atomically."""
    args = [b"EVAL", REPLAY_SCRIPT, b"0"]
    for command in commands:
        args.append(b"%d" % len(command))
        args.extend(command)
    return pack_command(args)


class JobWriter:
    """Sends waiting jobs in batches over one pooled connection; replies resolve futures."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._waiting: list[tuple[bytes, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    async def write(self, packed: bytes) -> None:
        """Return once Redis has run the job; raise what Redis or the connection raised."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((packed, future))
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        await future

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for _, future in self._waiting:
            future.cancel()
        self._waiting = []

    async def _run(self) -> None:
        try:
            while self._waiting:
                # Requests that gave up (timed out, disconnected) are not sent.
                batch = [(p, f) for p, f in self._waiting[:MAX_BATCH] if not f.done()]
                del self._waiting[:MAX_BATCH]
                if batch:
                    await self._send(batch)
        finally:
            self._task = None

    async def _send(self, batch: list[tuple[bytes, asyncio.Future[None]]]) -> None:
        try:
            # Unannotated in redis-py; returns a connected AbstractConnection.
            connection: AbstractConnection = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        except (RedisError, OSError) as exc:
            _fail(batch, exc)
            return
        try:
            await connection.send_packed_command(b"".join(p for p, _ in batch), check_health=False)
            for _, future in batch:
                try:
                    await connection.read_response()
                except ResponseError as exc:
                    # An error reply ends that job only; the connection is still in step.
                    _settle(future, exc)
                else:
                    _settle(future, None)
        except BaseException as exc:
            # Replies may be left unread: the connection is out of step, drop it.
            await _disconnect(connection)
            _fail(batch, exc if isinstance(exc, Exception) else EnqueueFailed("cancelled"))
            if not isinstance(exc, Exception):
                raise
        finally:
            await self._pool.release(connection)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _fail(batch: list[tuple[bytes, asyncio.Future[None]]], error: BaseException) -> None:
    for _, future in batch:
        _settle(future, error)


async def _disconnect(connection: AbstractConnection) -> None:
    with contextlib.suppress(Exception):
        await connection.disconnect()


class Enqueuer:
    """The ingress's side of the events queue: enqueue, ping, depth."""

    def __init__(self, settings: Settings) -> None:
        self.timeout = settings.enqueue_timeout
        self.template = JobTemplate.from_rq(settings)
        self.redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.enqueue_timeout,
            socket_connect_timeout=settings.enqueue_timeout,
            # Never resend on our own: a resent job could be written twice.
            retry=Retry(NoBackoff(), 0),
            max_connections=REDIS_CONNECTIONS,
        )
        self.writer = JobWriter(self.redis.connection_pool)

    async def enqueue(self, envelope: Envelope) -> float:
        """Write the job; the seconds it took. `EnqueueFailed` unless Redis accepted it."""
        started = time.perf_counter()
        packed = pack_job(self.template.commands(envelope))
        try:
            async with asyncio.timeout(self.timeout):
                await self.writer.write(packed)
        except (RedisError, OSError, TimeoutError) as exc:
            raise EnqueueFailed(f"{exc.__class__.__name__}: {exc}") from exc
        return time.perf_counter() - started

    async def ping(self) -> bool:
        try:
            async with asyncio.timeout(self.timeout):
                return bool(await self.redis.ping())
        except (RedisError, OSError, TimeoutError):
            return False

    async def depth(self) -> int | None:
        """Jobs waiting in the queue, or None when Redis does not answer."""
        try:
            async with asyncio.timeout(self.timeout):
                return int(await self.redis.llen(self.template.queue_key.decode()))
        except (RedisError, OSError, TimeoutError):
            return None

    async def close(self) -> None:
        await self.writer.close()
        await self.redis.aclose()
