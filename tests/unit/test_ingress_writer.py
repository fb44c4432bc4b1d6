"""The batched job writer, against fake connections: what is sent, when, and who hears what."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

from ingress.enqueue import JobWriter
from ingress.jobs import PackedJob, pack_commands, pack_jobs


class FakeConnection:
    """Redis as the writer sees one connection: every batch written gets a
    reply `delay` seconds later, in the order written."""

    def __init__(self, redis: FakeRedis) -> None:
        self.redis = redis
        self.reply = redis.replies.pop(0) if redis.replies else 1
        self.sent: list[bytes] = []
        self.disconnected = False
        self.lost: Exception | None = None
        self._closed = asyncio.Event()
        self._writer: FakeConnection | None = None
        self._replies: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()

    async def connect(self) -> None:
        await asyncio.sleep(self.redis.connect_delay)
        if self.redis.connect_errors:
            raise self.redis.connect_errors.pop(0)
        self._writer = self  # the writer calls `connection._writer.write(data)`

    def write(self, data: bytes) -> None:
        self.sent.append(data)
        loop = asyncio.get_running_loop()
        self._replies.put_nowait((loop.time() + self.redis.delay, self.reply))

    def close_from_server(self) -> None:
        """The server closes the connection (its `timeout`, a restart): the
        replies not yet read never come."""
        self.lost = RedisConnectionError("Connection closed by server.")
        self._closed.set()
        self._replies.put_nowait((0.0, None))  # wakes a reader waiting for one

    async def read_response(self, timeout: float | None = None) -> Any:
        ready_at, reply = await self._replies.get()
        remaining = ready_at - asyncio.get_running_loop().time()
        if remaining > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), remaining)
        if self.lost is not None:
            raise self.lost
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def disconnect(self) -> None:
        await asyncio.sleep(self.redis.disconnect_delay)
        self.disconnected = True
        self._writer = None


class FakeRedis:
    """Makes the writer's connections; `replies` gives each new one its reply
    (an error reply, say), one per connection, then 1."""

    def __init__(
        self,
        *,
        delay: float = 0.0,
        replies: list[Any] | None = None,
        connect_delay: float = 0.0,
        connect_errors: list[Exception] | None = None,
        disconnect_delay: float = 0.0,
    ) -> None:
        self.delay = delay
        self.replies = list(replies or [])
        self.connect_delay = connect_delay
        self.connect_errors = list(connect_errors or [])
        self.disconnect_delay = disconnect_delay
        self.made: list[FakeConnection] = []

    def __call__(self) -> FakeConnection:
        connection = FakeConnection(self)
        self.made.append(connection)
        return connection

    @property
    def sent(self) -> list[bytes]:
        return [batch for connection in self.made for batch in connection.sent]


def job(name: bytes) -> PackedJob:
    return pack_commands([[b"RPUSH", b"q", name]])


def batch(*names: bytes) -> bytes:
    return pack_jobs([job(name) for name in names])


def new_writer(redis: FakeRedis, timeout: float = 5, batch_size: int = 16) -> JobWriter:
    return JobWriter(redis, timeout, batch_size)  # type: ignore[arg-type]


def test_jobs_of_one_turn_go_in_one_eval_on_one_connection() -> None:
    redis = FakeRedis()
    jobs_writer = new_writer(redis)

    async def scenario() -> None:
        await asyncio.gather(*(jobs_writer.write(job(b"%d" % i)) for i in range(5)))
        await asyncio.gather(*(jobs_writer.write(job(b"%d" % i)) for i in range(5, 7)))

    asyncio.run(scenario())
    assert redis.sent == [batch(b"0", b"1", b"2", b"3", b"4"), batch(b"5", b"6")]
    assert len(redis.made) == 1


def test_a_full_batch_goes_out_at_once_while_the_turn_goes_on() -> None:
    redis = FakeRedis()
    jobs_writer = new_writer(redis, batch_size=3)
    seen: list[int] = []

    async def look() -> None:
        seen.append(len(redis.sent))

    async def scenario() -> None:
        await jobs_writer.write(job(b"warm"))  # connected
        # Tasks created together run one after the other in the same turn.
        writes = [jobs_writer.write(job(b"%d" % i)) for i in range(3)]
        later = [jobs_writer.write(job(b"%d" % i)) for i in range(3, 7)]
        await asyncio.gather(*writes, look(), *later)

    asyncio.run(scenario())
    assert seen == [2], "the first full batch was sent before the turn ended"
    assert redis.sent == [
        batch(b"warm"),
        batch(b"0", b"1", b"2"),
        batch(b"3", b"4", b"5"),
        batch(b"6"),
    ]


def test_batches_are_pipelined_without_waiting_for_earlier_replies() -> None:
    redis = FakeRedis(delay=0.2)
    jobs_writer = new_writer(redis)
    sent: list[int] = []
    done: list[bytes] = []

    async def write(name: bytes) -> None:
        await jobs_writer.write(job(name))
        done.append(name)

    async def scenario() -> None:
        tasks = []
        for name in (b"a", b"b", b"c"):
            tasks.append(asyncio.create_task(write(name)))
            await asyncio.sleep(0.03)
        sent.append(len(redis.sent))  # all three out, no reply yet
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert sent == [3] and done == [b"a", b"b", b"c"]
    assert redis.sent == [batch(b"a"), batch(b"b"), batch(b"c")]
    assert len(redis.made) == 1


def test_a_job_whose_request_gave_up_is_never_sent() -> None:
    redis = FakeRedis()
    jobs_writer = new_writer(redis)

    async def scenario() -> None:
        await jobs_writer.write(job(b"warm"))
        kept = asyncio.create_task(jobs_writer.write(job(b"kept")))
        gave_up = asyncio.create_task(jobs_writer.write(job(b"gave-up")))
        await asyncio.sleep(0)  # both are waiting; the turn has not ended
        gave_up.cancel()
        await kept

    asyncio.run(scenario())
    assert redis.sent == [batch(b"warm"), batch(b"kept")]


@pytest.mark.parametrize(
    "error",
    [
        OutOfMemoryError("command not allowed when used memory > 'maxmemory'"),
        ReadOnlyError("You can't write against a read only replica."),
    ],
)
def test_an_error_reply_fails_its_batch_and_the_next_batch_connects_anew(
    error: ResponseError,
) -> None:
    """After a failover the demoted primary keeps its clients and answers
    READONLY: the writer must connect anew, not reuse that connection."""
    redis = FakeRedis(replies=[error])
    jobs_writer = new_writer(redis)

    async def scenario() -> list[BaseException | None]:
        results = await asyncio.gather(
            jobs_writer.write(job(b"a")), jobs_writer.write(job(b"b")), return_exceptions=True
        )
        await jobs_writer.write(job(b"c"))
        assert not redis.made[-1].disconnected
        return list(results)

    results = asyncio.run(scenario())
    assert all(isinstance(result, type(error)) for result in results)
    first, second = redis.made
    assert first.disconnected and first.sent == [batch(b"a", b"b")]
    assert second.sent == [batch(b"c")]


def test_a_lost_connection_fails_every_batch_in_flight_and_is_replaced() -> None:
    redis = FakeRedis(delay=0.1)
    jobs_writer = new_writer(redis)

    async def scenario() -> list[BaseException | None]:
        await jobs_writer.write(job(b"warm"))
        first = asyncio.create_task(jobs_writer.write(job(b"a")))
        await asyncio.sleep(0.02)
        second = asyncio.create_task(jobs_writer.write(job(b"b")))
        await asyncio.sleep(0.02)  # two batches in flight
        redis.made[0].close_from_server()
        results = await asyncio.gather(first, second, return_exceptions=True)
        await jobs_writer.write(job(b"c"))
        return list(results)

    results = asyncio.run(scenario())
    assert [type(result) for result in results] == [RedisConnectionError] * 2
    assert redis.made[0].disconnected
    assert redis.made[1].sent == [batch(b"c")]


def test_a_connection_closed_while_idle_is_replaced_before_the_next_batch() -> None:
    """Redis closes idle clients (its `timeout`), restarts, or a proxy drops
    them: the writer sees it as it happens, and the next request is not a 503."""
    redis = FakeRedis()
    jobs_writer = new_writer(redis)

    async def scenario() -> None:
        await jobs_writer.write(job(b"a"))
        redis.made[0].close_from_server()
        await asyncio.sleep(0.01)  # the writer reads its idle connection
        await jobs_writer.write(job(b"b"))

    asyncio.run(scenario())
    first, second = redis.made
    assert first.disconnected and first.sent == [batch(b"a")]
    assert second.sent == [batch(b"b")]


def test_a_failed_connect_fails_the_waiting_requests_and_the_next_one_connects_again() -> None:
    redis = FakeRedis(connect_errors=[RedisConnectionError("Connection refused")])
    jobs_writer = new_writer(redis)

    async def scenario() -> list[BaseException | None]:
        results = await asyncio.gather(
            jobs_writer.write(job(b"a")), jobs_writer.write(job(b"b")), return_exceptions=True
        )
        await jobs_writer.write(job(b"c"))
        return list(results)

    results = asyncio.run(scenario())
    assert [type(result) for result in results] == [RedisConnectionError] * 2
    assert redis.sent == [batch(b"c")] and len(redis.made) == 2


def test_a_job_whose_request_gave_up_while_connecting_is_never_sent() -> None:
    redis = FakeRedis(connect_delay=0.2)
    jobs_writer = new_writer(redis, timeout=0.05)

    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await jobs_writer.write(job(b"late"))
        await asyncio.sleep(0.3)  # the writer has connected by now

    asyncio.run(scenario())
    assert redis.sent == []


def test_each_waiting_request_times_out_at_its_own_deadline_not_before() -> None:
    redis = FakeRedis(connect_delay=1)
    jobs_writer = new_writer(redis, timeout=0.1)

    async def request(loop: asyncio.AbstractEventLoop) -> tuple[float, float]:
        began = loop.time()
        with pytest.raises(TimeoutError):
            await jobs_writer.write(job(b"x"))
        return began, loop.time()

    async def scenario() -> list[tuple[float, float]]:
        loop = asyncio.get_running_loop()
        tasks = []
        for _ in range(3):
            tasks.append(asyncio.create_task(request(loop)))
            await asyncio.sleep(0.03)
        results = list(await asyncio.gather(*tasks))
        await jobs_writer.close()
        return results

    times = asyncio.run(scenario())
    for began, timed_out in times:
        assert timed_out >= began + 0.1
    # Staggered requests are not expired together with the first one.
    assert times[2][1] >= times[0][1] + 0.05


def test_a_late_reply_times_out_every_request_in_flight_and_drops_the_connection() -> None:
    """A Redis that stopped answering, or a peer lost without a word, would
    leave every later batch waiting on the same connection: it is replaced."""
    redis = FakeRedis(delay=0.5)
    jobs_writer = new_writer(redis, timeout=0.1)

    async def scenario() -> list[BaseException | None]:
        first = asyncio.create_task(jobs_writer.write(job(b"a")))
        await asyncio.sleep(0.03)
        second = asyncio.create_task(jobs_writer.write(job(b"b")))
        results = list(await asyncio.gather(first, second, return_exceptions=True))
        redis.delay = 0
        await jobs_writer.write(job(b"c"))
        return results

    results = asyncio.run(scenario())
    assert all(isinstance(result, TimeoutError) for result in results)
    first, second = redis.made
    assert first.disconnected and first.sent == [batch(b"a"), batch(b"b")]
    assert second.sent == [batch(b"c")]


def test_settled_requests_are_not_held_and_the_timer_stops() -> None:
    """Holding settled requests until their deadline would have the garbage
    collector promote and scan thousands of them."""
    jobs_writer = new_writer(FakeRedis(), timeout=0.05)
    held: list[int] = []

    async def scenario() -> None:
        await asyncio.gather(*(jobs_writer.write(job(b"%d" % i)) for i in range(10)))
        held.append(len(jobs_writer._waiting) + len(jobs_writer._in_flight))
        await asyncio.sleep(0.1)  # past every deadline: the sweep ran
        await jobs_writer.close()

    asyncio.run(scenario())
    assert held == [0]
    assert jobs_writer._sweeper is None


def test_closing_answers_waiting_and_in_flight_requests_with_a_connection_error() -> None:
    redis = FakeRedis(delay=10)
    jobs_writer = new_writer(redis, timeout=30)

    async def scenario() -> list[BaseException | None]:
        in_flight = asyncio.create_task(jobs_writer.write(job(b"a")))
        await asyncio.sleep(0.05)  # sent, its reply far off
        redis.connect_delay = 10
        redis.made[0].close_from_server()
        await asyncio.sleep(0.01)  # the writer lost its connection
        connecting = asyncio.create_task(jobs_writer.write(job(b"b")))
        await asyncio.sleep(0.05)  # waiting for a new connection
        await jobs_writer.close()
        return list(await asyncio.gather(in_flight, connecting, return_exceptions=True))

    results = asyncio.run(scenario())
    assert [type(result) for result in results] == [RedisConnectionError] * 2
    assert redis.sent == [batch(b"a")]
    assert redis.made[0].disconnected


def test_closing_answers_requests_in_flight_before_the_connection_is_closed() -> None:
    redis = FakeRedis(delay=10, disconnect_delay=0.2)
    jobs_writer = new_writer(redis, timeout=30)

    async def scenario() -> BaseException | None:
        request = asyncio.create_task(jobs_writer.write(job(b"a")))
        await asyncio.sleep(0.05)  # in flight
        closing = asyncio.create_task(jobs_writer.close())
        done, _ = await asyncio.wait([request], timeout=0.1)  # before the close is done
        assert done, "the request was left waiting for the connection to close"
        await closing
        return request.exception()

    assert isinstance(asyncio.run(scenario()), RedisConnectionError)


def test_a_writer_that_outlived_its_event_loop_connects_anew_on_the_next() -> None:
    redis = FakeRedis()
    jobs_writer = new_writer(redis, timeout=0.2)
    asyncio.run(jobs_writer.write(job(b"a")))  # the loop ends, the writer unclosed
    redis.delay = 3600

    async def next_loop() -> None:
        await asyncio.wait_for(jobs_writer.write(job(b"b")), 2)

    with pytest.raises(TimeoutError) as raised:
        asyncio.run(next_loop())
    assert "Redis did not reply in time" in str(raised.value)
    assert len(redis.made) == 2 and redis.made[1].sent == [batch(b"b")]


class ClosedTransport(FakeConnection):
    """A connection whose transport closed before its reader saw it: uvloop's
    transport refuses the write with a RuntimeError."""

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")


def test_a_write_the_transport_refuses_is_a_connection_error_and_the_next_batch_connects_anew() -> (
    None
):
    redis = FakeRedis()
    made = redis.made
    connections = iter([ClosedTransport, FakeConnection])

    def connect() -> FakeConnection:
        connection = next(connections)(redis)
        made.append(connection)
        return connection

    jobs_writer = JobWriter(connect, 5)  # type: ignore[arg-type]

    async def scenario() -> BaseException | None:
        try:
            await jobs_writer.write(job(b"a"))
        except Exception as exc:
            error: BaseException | None = exc
        else:
            error = None
        await jobs_writer.write(job(b"b"))
        return error

    assert isinstance(asyncio.run(scenario()), RedisConnectionError)
    assert made[1].sent == [batch(b"b")]
