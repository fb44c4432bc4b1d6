"""The batched job writer, against a fake connection: what is sent, and who hears what."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

from ingress.enqueue import JobWriter
from ingress.jobs import PackedJob, pack_commands, pack_jobs


class FakeConnection:
    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.sent: list[bytes] = []
        self.disconnected = False

    async def send_packed_command(self, command: bytes, check_health: bool = True) -> None:
        self.sent.append(command)

    async def read_response(self) -> Any:
        await asyncio.sleep(0)
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    async def disconnect(self) -> None:
        self.disconnected = True


class FakePool:
    def __init__(self, connection: FakeConnection, connect_delay: float = 0) -> None:
        self.connection = connection
        self.connect_delay = connect_delay
        self.released = 0
        self.disconnected = False

    async def get_connection(self) -> FakeConnection:
        await asyncio.sleep(self.connect_delay)
        return self.connection

    async def release(self, connection: FakeConnection) -> None:
        self.released += 1

    async def disconnect(self) -> None:
        self.disconnected = True


def job(name: bytes) -> PackedJob:
    return pack_commands([[b"RPUSH", b"q", name]])


def writer(reply: Any) -> tuple[JobWriter, FakeConnection, FakePool]:
    connection = FakeConnection(reply)
    pool = FakePool(connection)
    return JobWriter(pool, 5), connection, pool  # type: ignore[arg-type]


def test_jobs_waiting_together_go_in_one_eval() -> None:
    jobs_writer, connection, pool = writer(1)

    async def scenario() -> None:
        await asyncio.gather(*(jobs_writer.write(job(b"%d" % i)) for i in range(5)))

    asyncio.run(scenario())
    assert connection.sent == [pack_jobs([job(b"%d" % i) for i in range(5)])]
    assert pool.released == 1


def test_a_job_whose_request_gave_up_is_never_sent() -> None:
    jobs_writer, connection, _ = writer(1)

    async def scenario() -> None:
        kept = asyncio.create_task(jobs_writer.write(job(b"kept")))
        gave_up = asyncio.create_task(jobs_writer.write(job(b"gave-up")))
        await asyncio.sleep(0)  # both are waiting; the writer has not sent yet
        gave_up.cancel()
        await kept

    asyncio.run(scenario())
    assert connection.sent == [pack_jobs([job(b"kept")])]


@pytest.mark.parametrize(
    "error",
    [
        OutOfMemoryError("command not allowed when used memory > 'maxmemory'"),
        ReadOnlyError("You can't write against a read only replica."),
    ],
)
def test_an_error_reply_fails_every_job_of_the_batch_and_drops_the_connection(
    error: ResponseError,
) -> None:
    """After a failover the demoted primary keeps its clients and answers
    READONLY: the writer must connect anew, not reuse that connection."""
    jobs_writer, connection, pool = writer(error)

    async def scenario() -> list[BaseException | None]:
        results = await asyncio.gather(
            jobs_writer.write(job(b"a")), jobs_writer.write(job(b"b")), return_exceptions=True
        )
        return list(results)

    results = asyncio.run(scenario())
    assert all(isinstance(result, type(error)) for result in results)
    assert connection.disconnected and pool.released == 1


def test_a_job_whose_request_gave_up_while_connecting_is_never_sent() -> None:
    connection = FakeConnection(1)
    jobs_writer = JobWriter(FakePool(connection, connect_delay=0.2), 0.05)  # type: ignore[arg-type]

    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await jobs_writer.write(job(b"late"))
        await asyncio.sleep(0.3)  # the writer has connected by now

    asyncio.run(scenario())
    assert connection.sent == []


def test_closing_answers_waiting_requests_with_a_connection_error() -> None:
    connection = FakeConnection(1)
    pool = FakePool(connection, connect_delay=10)
    jobs_writer = JobWriter(pool, 30)  # type: ignore[arg-type]

    async def scenario() -> list[BaseException | None]:
        in_batch = asyncio.create_task(jobs_writer.write(job(b"a")))
        await asyncio.sleep(0.05)  # the writer took it and is connecting
        queued = asyncio.create_task(jobs_writer.write(job(b"b")))
        await asyncio.sleep(0.05)  # waiting for the next batch
        await jobs_writer.close()
        return list(await asyncio.gather(in_batch, queued, return_exceptions=True))

    results = asyncio.run(scenario())
    assert [type(result) for result in results] == [RedisConnectionError] * 2
    assert connection.sent == [] and pool.disconnected


def test_a_lost_connection_fails_the_batch_and_is_dropped() -> None:
    jobs_writer, connection, pool = writer(RedisConnectionError("reset by peer"))

    async def scenario() -> None:
        await jobs_writer.write(job(b"a"))

    with pytest.raises(RedisConnectionError):
        asyncio.run(scenario())
    assert connection.disconnected and pool.released == 1


class SlowConnection(FakeConnection):
    """Redis that takes `delay` seconds to reply."""

    def __init__(self, delay: float) -> None:
        super().__init__(1)
        self.delay = delay

    async def read_response(self) -> Any:
        await asyncio.sleep(self.delay)
        return self.reply


def test_no_reply_in_time_is_a_timeout_and_a_job_expired_unsent_is_never_sent() -> None:
    connection = SlowConnection(0.3)
    jobs_writer = JobWriter(FakePool(connection), 0.1, lanes=1)  # type: ignore[arg-type]

    async def scenario() -> list[BaseException | None]:
        first = asyncio.create_task(jobs_writer.write(job(b"in-flight")))
        await asyncio.sleep(0.01)  # the first batch is sent, its reply is slow
        second = asyncio.create_task(jobs_writer.write(job(b"expires-waiting")))
        results = await asyncio.gather(first, second, return_exceptions=True)
        await asyncio.sleep(0.4)  # the writer finishes the slow batch
        return list(results)

    results = asyncio.run(scenario())
    assert all(isinstance(result, TimeoutError) for result in results)
    assert connection.sent == [pack_jobs([job(b"in-flight")])]


def test_a_second_batch_goes_out_while_the_first_waits_and_a_third_waits_for_a_lane() -> None:
    connection = SlowConnection(0.2)
    jobs_writer = JobWriter(FakePool(connection), 5, lanes=2)  # type: ignore[arg-type]
    sent: list[list[bytes]] = []

    async def scenario() -> None:
        first = asyncio.create_task(jobs_writer.write(job(b"a")))
        await asyncio.sleep(0.05)  # "a" is in flight on the first lane
        second = asyncio.create_task(jobs_writer.write(job(b"b")))
        await asyncio.sleep(0.05)  # "b" is in flight on the second
        sent.append(list(connection.sent))
        third = asyncio.gather(jobs_writer.write(job(b"c")), jobs_writer.write(job(b"d")))
        await asyncio.sleep(0.05)  # both lanes are busy: "c" and "d" wait
        sent.append(list(connection.sent))
        await asyncio.gather(first, second, third)
        sent.append(list(connection.sent))

    asyncio.run(scenario())
    a, b, c_and_d = (pack_jobs([job(b"a")]), pack_jobs([job(b"b")]),
                     pack_jobs([job(b"c"), job(b"d")]))  # fmt: skip
    assert sent == [[a, b], [a, b], [a, b, c_and_d]]
    assert jobs_writer._tasks == set() and jobs_writer._in_flight == []


def test_each_request_times_out_at_its_own_deadline_not_before() -> None:
    connection = SlowConnection(0.5)
    jobs_writer = JobWriter(FakePool(connection), 0.1)  # type: ignore[arg-type]

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
        return list(await asyncio.gather(*tasks))

    times = asyncio.run(scenario())
    for began, timed_out in times:
        assert timed_out >= began + 0.1
    # Staggered requests are not expired together with the first one.
    assert times[2][1] >= times[0][1] + 0.05


def test_settled_requests_are_not_held_and_the_timer_stops() -> None:
    """Holding settled requests until their deadline would have the garbage
    collector promote and scan thousands of them."""
    jobs_writer = JobWriter(FakePool(FakeConnection(1)), 0.05)  # type: ignore[arg-type]
    held: list[int] = []

    async def scenario() -> None:
        await asyncio.gather(*(jobs_writer.write(job(b"%d" % i)) for i in range(10)))
        held.append(len(jobs_writer._waiting) + len(jobs_writer._in_flight))
        await asyncio.sleep(0.1)  # past every deadline: the sweep ran

    asyncio.run(scenario())
    assert held == [0]
    assert jobs_writer._sweeper is None


class SlowToDisconnect(FakeConnection):
    """A connection whose reply fails, and which takes a while to close."""

    async def read_response(self) -> Any:
        await asyncio.sleep(0.01)
        raise RedisConnectionError("reset by peer")

    async def disconnect(self) -> None:
        await asyncio.sleep(0.1)
        self.disconnected = True


def test_closing_while_a_failed_batch_disconnects_still_answers_its_requests() -> None:
    jobs_writer = JobWriter(FakePool(SlowToDisconnect(1)), 1)  # type: ignore[arg-type]

    async def scenario() -> BaseException | None:
        request = asyncio.create_task(jobs_writer.write(job(b"a")))
        await asyncio.sleep(0.05)  # the reply failed; the writer is disconnecting
        await jobs_writer.close()
        done, _ = await asyncio.wait([request], timeout=0.5)  # well before its deadline
        assert done, "the request was left waiting"
        return request.exception()

    assert isinstance(asyncio.run(scenario()), RedisConnectionError)


class NeverReplies(FakeConnection):
    async def read_response(self) -> Any:
        await asyncio.sleep(3600)


def test_a_writer_that_outlived_its_event_loop_still_times_out_on_the_next() -> None:
    pool = FakePool(FakeConnection(1))
    jobs_writer = JobWriter(pool, 0.2)  # type: ignore[arg-type]
    asyncio.run(jobs_writer.write(job(b"a")))  # the loop ends, the writer unclosed
    pool.connection = NeverReplies(1)

    async def next_loop() -> None:
        await asyncio.wait_for(jobs_writer.write(job(b"b")), 2)

    with pytest.raises(TimeoutError) as raised:
        asyncio.run(next_loop())
    assert "Redis did not reply in time" in str(raised.value)
