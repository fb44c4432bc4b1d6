"""Put event jobs on the RQ queue with redis.asyncio, without blocking the event loop.

The writer sends every job waiting at that moment as one `EVAL` that runs
their commands (RQ's own, see `ingress.jobs`) atomically (group commit): a
burst of requests costs one round trip and one reply, not one each, and no
worker sees a job half-written. (A command failing inside the script, on a
key of the wrong type, fails the batch; Redis keeps what the script wrote
before it.) Up to `LANES` batches are in flight at once, each on its own
connection.

A request waits for its own reply at most `settings.enqueue_timeout` seconds
(and up to `SWEEP_SLACK` more: one timer serves every request). A job whose
request gave up before it was sent is dropped, never sent late.

The writer's connections are its own: the probes (`/readyz`, `/metrics`)
draw from a separate pool, so however many are in flight, they never take
a connection webhooks are queued through.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import (
    AbstractConnection,
    BlockingConnectionPool,
    ConnectionPool,
)
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.maint_notifications import MaintNotificationsConfig

from ingress.jobs import JobTemplate, PackedJob, pack_jobs
from payhook.envelope import Envelope
from payhook.errors import PayhookError
from payhook.settings import Settings

#: Most jobs in one `EVAL`; Redis runs a script without interruption, so
#: this bounds how long one batch holds it.
MAX_BATCH = 256
#: Batches in flight at once, each on a connection of its own. With one, the
#: requests that arrive while Redis writes and fsyncs a batch wait for its
#: reply, then for the round trip of their own: the ingress idles for both.
LANES = 2
#: Connections for the probes, per process; the writer has its own.
PROBE_CONNECTIONS = 2
#: Seconds a request may wait past its deadline, so that one sweep expires
#: a burst of requests rather than one sweep each.
SWEEP_SLACK = 0.005


class EnqueueFailed(PayhookError):
    """Redis did not accept the job."""


#: A request waiting for Redis: its job, its future, its deadline (loop time).
Waiting = tuple[PackedJob, "asyncio.Future[None]", float]


class JobWriter:
    """Sends waiting jobs in batches over pooled connections; replies resolve futures.

    Up to `lanes` batches are in flight at once, one per connection: while
    one waits for Redis to write and fsync it, the requests that arrived
    meanwhile go out as the next, and Redis takes that batch as soon as it
    is done with the first instead of a round trip later.
    """

    def __init__(self, pool: ConnectionPool, timeout: float, lanes: int = LANES) -> None:
        self._pool = pool
        self._timeout = timeout
        self._lanes = lanes
        #: Requests not yet sent, then the batches whose replies are awaited,
        #: oldest first: both in order of arrival, so of deadline, the
        #: timeout being the same.
        self._waiting: list[Waiting] = []
        self._in_flight: list[list[Waiting]] = []
        #: One task per lane in use, each taking a batch and sending it.
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def write(self, packed: PackedJob) -> None:
        """Return once Redis has run the job; raise what Redis or the connection
        raised, or `TimeoutError` after the writer's timeout without a reply."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # A writer that outlived its event loop unclosed keeps nothing of
            # it: a task or timer of a closed loop would never run.
            self._loop = loop
            self._tasks, self._sweeper = set(), None
            self._waiting, self._in_flight = [], []
        future: asyncio.Future[None] = loop.create_future()
        deadline = loop.time() + self._timeout
        self._waiting.append((packed, future, deadline))
        # A lane whose task is between batches takes this one too; a new
        # lane opens only when every open one has a batch in flight.
        if len(self._tasks) == len(self._in_flight) < self._lanes:
            self._tasks.add(asyncio.create_task(self._run()))
        # One timer for all requests rather than one each (a cancel scope
        # around the await costs more still): 6 µs less per request, measured
        # in the ingress. Nothing outlives its request: a request is held by
        # the writer only while it waits or is in flight, so settled ones
        # leave nothing for the garbage collector to promote and scan.
        if self._sweeper is None:
            self._sweeper = loop.call_at(deadline, self._sweep, loop)
        await future

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Expire every request past its deadline, in flight or waiting. An
        expired job is skipped if not yet sent; if it was, its reply is ignored."""
        now = loop.time()
        self._sweeper = None
        for pending in (*self._in_flight, self._waiting):
            for _, future, deadline in pending:
                if deadline > now:
                    # The next sweep: this deadline, or later by a hair so
                    # that a burst of deadlines is swept together.
                    self._sweeper = loop.call_at(
                        max(deadline, now + SWEEP_SLACK), self._sweep, loop
                    )
                    return
                _expire(future)

    async def close(self) -> None:
        """Stop the writer; requests waiting or in flight get a connection error (503)."""
        tasks = list(self._tasks)
        # A batch in flight is answered by `_send` as it is cancelled.
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        _settle_all(self._waiting, RedisConnectionError("the writer stopped"))
        self._waiting, self._in_flight = [], []
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        await self._pool.disconnect()

    async def _run(self) -> None:
        try:
            while self._waiting:
                # One turn of the event loop: every request already past its
                # checks joins this batch instead of waiting for the next.
                await asyncio.sleep(0)
                # Requests that gave up (timed out, disconnected) are not sent.
                batch = [entry for entry in self._waiting[:MAX_BATCH] if not entry[1].done()]
                del self._waiting[:MAX_BATCH]
                if batch:
                    self._in_flight.append(batch)
                    try:
                        await self._send(batch)
                    finally:
                        self._in_flight.remove(batch)
        finally:
            # At once, not in a done callback a turn later: a request queued
            # in between would find this lane taken and no task to send it.
            self._tasks.discard(asyncio.current_task())

    async def _send(self, batch: list[Waiting]) -> None:
        try:
            # Unannotated in redis-py; returns a connected AbstractConnection.
            connection: AbstractConnection = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        except BaseException as exc:
            _settle_all(batch, _as_error(exc))
            if not isinstance(exc, Exception):
                raise
            return
        try:
            # Connecting may have taken a while: requests that gave up
            # meanwhile are not sent either.
            batch = [entry for entry in batch if not entry[1].done()]
            if not batch:
                return
            await connection.send_packed_command(
                pack_jobs([entry[0] for entry in batch]), check_health=False
            )
            await connection.read_response()
            _settle_all(batch, None)
        except BaseException as exc:
            # Replies may be left unread: the connection is out of step. Or the
            # script failed: out of memory, or READONLY from a primary demoted
            # in a failover, which keeps its clients; the next batch connects
            # anew, to whatever the address names now. Either way, drop it,
            # once the batch's requests have their answer.
            _settle_all(batch, _as_error(exc))
            await _disconnect(connection)
            if not isinstance(exc, Exception):
                raise
        finally:
            await self._pool.release(connection)


def _as_error(exc: BaseException) -> Exception:
    """What a waiting request gets: the failure itself, or for a cancelled writer
    (shutdown) a connection error, which it answers with a 503."""
    return exc if isinstance(exc, Exception) else RedisConnectionError("the writer stopped")


def _expire(future: asyncio.Future[None]) -> None:
    _settle(future, TimeoutError("Redis did not reply in time"))


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _settle_all(batch: list[Waiting], error: BaseException | None) -> None:
    """Settle every future of the batch still waiting: with `error`, or done if None."""
    for entry in batch:
        _settle(entry[1], error)


async def _disconnect(connection: AbstractConnection) -> None:
    with contextlib.suppress(Exception):
        await connection.disconnect()


class Enqueuer:
    """The ingress's side of the events queue: enqueue, ping, depth."""

    def __init__(self, settings: Settings) -> None:
        self.timeout = settings.enqueue_timeout
        self.template = JobTemplate.from_rq(settings)
        options: dict[str, Any] = {
            "socket_timeout": settings.enqueue_timeout,
            "socket_connect_timeout": settings.enqueue_timeout,
            # Never resend on our own: a resent job could be written twice.
            "retry": Retry(NoBackoff(), 0),
            # redis-py speaks RESP3 and, with maintenance notifications on (its
            # default there), hands out a pooled connection without checking
            # that the server has not closed it: after Redis dropped an idle
            # client (its `timeout`, a restart, a proxy's idle limit) the next
            # batch would fail with a 503. Off, the pool finds the closed
            # socket before anything is sent and connects anew.
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }
        self.writer = JobWriter(
            ConnectionPool.from_url(settings.redis_url, max_connections=LANES, **options),
            settings.enqueue_timeout,
        )
        # Probes beyond the pool's size wait for a connection, then time out.
        self._probes = BlockingConnectionPool.from_url(
            settings.redis_url,
            max_connections=PROBE_CONNECTIONS,
            timeout=settings.enqueue_timeout,
            **options,
        )
        self.redis = aioredis.Redis(connection_pool=self._probes)

    async def enqueue(self, envelope: Envelope) -> float:
        """Write the job; the seconds it took. `EnqueueFailed` unless Redis accepted it."""
        started = time.perf_counter()
        packed = self.template.packed(envelope)
        try:
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
        await self._probes.disconnect()
