"""Put event jobs on the RQ queue with redis.asyncio, without blocking the event loop.

The writer sends waiting jobs as one `EVAL` that runs their commands (RQ's
own, see `ingress.jobs`) atomically (group commit): a burst of requests costs
one round trip and one reply, not one each, and no worker sees a job
half-written. (A command failing inside the script, on a key of the wrong
type, fails the batch; Redis keeps what the script wrote before it.)

Batches are pipelined on one connection: each goes out as soon as it is
made, without waiting for the replies of those before it, and one task reads
the replies, which Redis sends in order. A batch is made at the end of the
event loop's turn, or as soon as `BATCH_SIZE` jobs wait, while the requests
of the same turn are still being checked: Redis writes and fsyncs the first
jobs of a burst while the ingress checks the rest.

A request waits for its own reply at most `settings.enqueue_timeout` seconds
(and up to `SWEEP_SLACK` more: one timer serves every request). A job whose
request gave up before it was sent is dropped, never sent late. A reply
later than that drops the connection: a Redis that stopped answering, or a
peer lost without a word, is replaced rather than waited on.

The writer's connection is its own: the probes (`/readyz`, `/metrics`) draw
from a separate pool, so however many are in flight, they never delay a
batch of webhooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.maint_notifications import MaintNotificationsConfig

from ingress.jobs import JobTemplate, PackedJob, pack_jobs
from payhook.compat import writer_of
from payhook.envelope import Envelope
from payhook.errors import PayhookError
from payhook.redis_client import async_pool
from payhook.settings import Settings, positive_int

#: Jobs that make a batch before the event loop's turn ends. Measured side by
#: side under wrk (32 connections): 16 beat 8, 24 and no limit, and every one
#: of them beat batches made only at turn ends, which carried a whole burst
#: at once and left the ingress idle while Redis wrote and fsynced it.
BATCH_SIZE = 16
#: Most jobs in one `EVAL` (a backlog sent once connected); Redis runs a
#: script without interruption, so this bounds how long one batch holds it.
MAX_BATCH = 256
#: Connections for the probes, per process; the writer has its own.
PROBE_CONNECTIONS = 2
#: Seconds a request may wait past its deadline, so that one sweep expires
#: a burst of requests rather than one sweep each.
SWEEP_SLACK = 0.005


class EnqueueFailed(PayhookError):
    """Redis did not accept the job."""


class NotReplicated(RedisError):
    """Fewer replicas than `PAYHOOK_ENQUEUE_REPLICAS` confirmed a batch in time."""


#: A request waiting for Redis: its job, its future, its deadline (loop time).
Waiting = tuple[PackedJob, "asyncio.Future[None]", float]


class JobWriter:
    """Sends waiting jobs in batches pipelined on one connection; replies resolve futures.

    `connect` makes a connection, not yet connected: redis-py's, of the class
    and with the options the Redis URL gives (TLS, a socket, a password, a
    database), which it sets up on `connect()`.
    """

    def __init__(
        self,
        connect: Callable[[], AbstractConnection],
        timeout: float,
        batch_size: int = BATCH_SIZE,
        replicas: int = 0,
    ) -> None:
        self._new_connection = connect
        self._timeout = timeout
        self._batch_size = batch_size
        #: Replicas that must hold a batch before its requests are answered:
        #: each batch is followed by `WAIT replicas ms` on its connection.
        self._replicas = replicas
        self._wait = _wait_command(replicas, timeout) if replicas else b""
        #: Requests not yet sent, then the batches whose replies are awaited,
        #: oldest first: both in order of arrival, so of deadline, the
        #: timeout being the same.
        self._waiting: list[Waiting] = []
        self._in_flight: deque[list[Waiting]] = deque()
        #: The connection batches go out on, once connected, and the task
        #: reading its replies; or the task connecting one.
        self._connection: AbstractConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._flush_soon: asyncio.Handle | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def write(self, packed: PackedJob) -> None:
        """Return once Redis has run the job; raise what Redis or the connection
        raised, or `TimeoutError` after the writer's timeout without a reply."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # A writer that outlived its event loop unclosed keeps nothing of
            # it: a connection, task or timer of a closed loop is of no use.
            self._forget(loop)
        future: asyncio.Future[None] = loop.create_future()
        deadline = loop.time() + self._timeout
        self._waiting.append((packed, future, deadline))
        if len(self._waiting) >= self._batch_size and self._connection is not None:
            self._send_waiting(self._connection)
        elif self._flush_soon is None:
            self._flush_soon = loop.call_soon(self._flush)
        # One timer for all requests rather than one each (a cancel scope
        # around the await costs more still): 6 µs less per request, measured
        # in the ingress. Nothing outlives its request: a request is held by
        # the writer only while it waits or is in flight, so settled ones
        # leave nothing for the garbage collector to promote and scan.
        if self._sweeper is None:
            self._sweeper = loop.call_at(deadline, self._sweep, loop)
        await future

    def _flush(self) -> None:
        """At the end of a turn: send every waiting job, or connect first."""
        self._flush_soon = None
        if self._connection is not None:
            self._send_waiting(self._connection)
        elif self._waiting and self._connecting is None:
            assert self._loop is not None
            self._connecting = self._loop.create_task(self._connect())

    def _send_waiting(self, connection: AbstractConnection) -> None:
        while self._waiting:
            # Requests that gave up (timed out, disconnected) are not sent.
            batch = [entry for entry in self._waiting[:MAX_BATCH] if not entry[1].done()]
            del self._waiting[:MAX_BATCH]
            if not batch:
                continue
            try:
                _send_now(connection, pack_jobs([entry[0] for entry in batch]) + self._wait)
            except Exception as exc:
                _settle_all(batch, exc)
                self._drop(connection, exc)
                return
            self._in_flight.append(batch)

    async def _connect(self) -> None:
        connection = self._new_connection()
        try:
            await connection.connect()  # type: ignore[no-untyped-call]
        except BaseException as exc:
            self._connecting = None
            # The requests waiting now were all to go out on it; those that
            # come while it closes try a connection of their own.
            waiting, self._waiting = self._waiting, []
            _settle_all(waiting, _as_error(exc))
            await _disconnect(connection)
            if not isinstance(exc, Exception):
                raise
            return
        self._connecting = None
        assert self._loop is not None
        self._connection = connection
        self._reader = self._loop.create_task(self._read(connection))
        self._send_waiting(connection)

    async def _read(self, connection: AbstractConnection) -> None:
        """Settle the batches in flight as their replies come, oldest first.

        It reads while nothing is in flight too: a connection Redis closes
        while idle (its `timeout`, a restart, a proxy's idle limit) is seen
        closed at once and replaced before the next batch, not found closed
        by it.
        """
        try:
            while True:
                # No timeout here: the sweeper drops a connection whose reply is late.
                await connection.read_response(timeout=math.inf)
                if not self._in_flight:
                    raise RedisConnectionError("Redis replied to nothing the writer sent")
                if self._replicas:
                    # The batch's WAIT: how many replicas hold it (and all before it).
                    held = await connection.read_response(timeout=math.inf)
                    if not isinstance(held, int) or held < self._replicas:
                        error = NotReplicated(
                            f"{held} of {self._replicas} replica(s) confirmed the job in time"
                        )
                        _settle_all(self._in_flight.popleft(), error)
                        continue
                _settle_all(self._in_flight.popleft(), None)
        except asyncio.CancelledError:
            # Dropped by the writer (a late reply, shutdown), which answered its batches.
            raise
        except Exception as exc:
            # An error reply: out of memory, or READONLY from a primary
            # demoted in a failover, which keeps its clients; the next batch
            # connects anew, to whatever the address names now. Or the
            # connection is gone. Either way its batches get the error.
            self._drop(connection, exc)
        finally:
            await _disconnect(connection)

    def _drop(self, connection: AbstractConnection, error: Exception) -> None:
        """Stop using `connection`: its batches in flight get `error`, its reader
        stops (and closes it), and the jobs still waiting go out on a new one."""
        if connection is not self._connection:
            return
        reader, self._reader, self._connection = self._reader, None, None
        in_flight, self._in_flight = self._in_flight, deque()
        for batch in in_flight:
            _settle_all(batch, error)
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        if self._waiting and self._flush_soon is None and self._loop is not None:
            self._flush_soon = self._loop.call_soon(self._flush)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Expire every request past its deadline, in flight or waiting. An
        expired job is skipped if not yet sent; if it was, its connection is
        dropped: Redis is not answering it in time."""
        now = loop.time()
        self._sweeper = None
        late_reply = bool(self._in_flight) and self._in_flight[0][0][2] <= now
        for pending in (*self._in_flight, self._waiting):
            deadline = _expire_until(pending, now)
            if deadline is not None:
                # The next sweep: that deadline, or later by a hair so that
                # a burst of deadlines is swept together.
                self._sweeper = loop.call_at(max(deadline, now + SWEEP_SLACK), self._sweep, loop)
                break
        if late_reply and self._connection is not None:
            self._drop(self._connection, TimeoutError("Redis did not reply in time"))

    async def close(self) -> None:
        """Stop the writer; requests waiting or in flight get a connection error (503)."""
        stopped = RedisConnectionError("the writer stopped")
        tasks = [task for task in (self._connecting, self._reader) if task is not None]
        if self._connection is not None:
            self._drop(self._connection, stopped)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        waiting, self._waiting = self._waiting, []
        _settle_all(waiting, stopped)
        for handle in (self._flush_soon, self._sweeper):
            if handle is not None:
                handle.cancel()
        self._flush_soon = self._sweeper = None

    def _forget(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._connection = self._reader = self._connecting = None
        self._flush_soon = self._sweeper = None
        self._waiting, self._in_flight = [], deque()


def _wait_command(replicas: int, timeout: float) -> bytes:
    """`WAIT replicas ms`, as the writer appends it to each batch: half the
    request's timeout, so its own reply comes before the request gives up."""
    args = [b"WAIT", str(replicas).encode(), str(max(1, int(timeout * 500))).encode()]
    return b"*3\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)


def _send_now(connection: AbstractConnection, data: bytes) -> None:
    """Hand `data` to the connection's transport in this turn of the event loop.

    redis-py's `send_packed_command` is a coroutine, and with a socket timeout
    it runs under `asyncio.wait_for`, a task of its own: the bytes would leave
    a turn later, after every request of this one. The writer needs a full
    batch on the wire while those requests are still being checked, so it
    writes to the connection's stream writer (`payhook.compat.writer_of`)
    itself. The transport takes the bytes whole and sends what the socket
    accepts; a Redis that stops reading shows as a late reply, which drops
    the connection.
    """
    writer = writer_of(connection)
    if writer is None:
        raise RedisConnectionError("the connection is closed")
    try:
        writer.write(data)
    except Exception as exc:
        # A transport closed under the writer (its reader has not yet seen
        # the connection go) refuses the bytes: a connection error, a 503.
        raise RedisConnectionError(f"writing to Redis failed: {exc!r}") from exc


def _as_error(exc: BaseException) -> Exception:
    """What a waiting request gets: the failure itself, or for a cancelled writer
    (shutdown) a connection error, which it answers with a 503."""
    return exc if isinstance(exc, Exception) else RedisConnectionError("the writer stopped")


def _expire_until(pending: list[Waiting], now: float) -> float | None:
    """Expire the requests of `pending` whose deadline is past, up to the first
    whose deadline is not; that deadline, or None if none is left."""
    for _, future, deadline in pending:
        if deadline > now:
            return deadline
        _expire(future)
    return None


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


def enqueue_replicas(settings: Settings) -> int:
    """`PAYHOOK_ENQUEUE_REPLICAS`: replicas that must confirm a job before
    its request is answered 2xx (0, the default: the master's reply)."""
    raw = settings.get("PAYHOOK_ENQUEUE_REPLICAS")
    if raw is None or raw.strip() == "":
        return 0
    return positive_int("PAYHOOK_ENQUEUE_REPLICAS", raw.strip(), minimum=0)


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
            # probe would fail. Off, the probes' pool finds the closed socket
            # before anything is sent and connects anew. (The writer reads its
            # connection at all times and sees it closed at once.)
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }
        # The pool only makes the writer's connection, of the URL's class and
        # options, or one that asks the Sentinels where the master is.
        self.writer = JobWriter(
            async_pool(settings, **options).make_connection,
            settings.enqueue_timeout,
            replicas=enqueue_replicas(settings),
        )
        # Probes beyond the pool's size wait for a connection, then time out
        # (or, through Sentinels, fail at once).
        self._probes = async_pool(
            settings,
            max_connections=PROBE_CONNECTIONS,
            blocking_timeout=settings.enqueue_timeout,
            **options,
        )
        self.redis = aioredis.Redis(connection_pool=self._probes)

    async def enqueue(self, envelopes: Sequence[Envelope]) -> float:
        """Write the jobs, all or none (one `EVAL`); the seconds it took.
        `EnqueueFailed` unless Redis accepted them."""
        started = time.perf_counter()
        packed = [self.template.packed(envelope) for envelope in envelopes]
        whole = (
            packed[0]
            if len(packed) == 1
            else PackedJob(sum(job.argc for job in packed), b"".join(job.argv for job in packed))
        )
        try:
            await self.writer.write(whole)
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
