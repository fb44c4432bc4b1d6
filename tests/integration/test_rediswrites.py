"""Commands queued on a pipeline, written as one atomic EVAL."""

from __future__ import annotations

import pytest
from redis import Redis
from redis.exceptions import ResponseError
from rq.job import JobStatus

from payhook import rediswrites


def test_a_pipeline_replayed_writes_what_its_execute_would(redis_conn: Redis) -> None:
    values: list[bytes | str | int | float] = [
        b"raw\x00bytes",
        "text é",
        42,
        -7,
        1.5,
        1e-07,
        1234567.125,
        JobStatus.FINISHED,
    ]
    with redis_conn.pipeline() as pipe:
        for i, value in enumerate(values):
            pipe.hset("executed", f"f{i}", value)
        pipe.execute()
    with redis_conn.pipeline() as pipe:
        for i, value in enumerate(values):
            pipe.hset("replayed", f"f{i}", value)
        pipe.expire("replayed", 60)
        rediswrites.replay(redis_conn, pipe)
        assert len(pipe) == 0, "the pipeline is emptied"
    assert redis_conn.hgetall("replayed") == redis_conn.hgetall("executed")
    assert 0 < redis_conn.ttl("replayed") <= 60


def test_an_argument_redis_py_would_not_write_is_refused(redis_conn: Redis) -> None:
    with redis_conn.pipeline() as pipe:
        pipe.set("key", 1)
        pipe.command_stack.append((("SET", "other", object()), {}))
        with pytest.raises(TypeError):
            rediswrites.replay(redis_conn, pipe)
    assert redis_conn.exists("key", "other") == 0, "nothing sent"


def test_a_command_redis_refuses_raises_and_the_connection_stays_usable(
    redis_conn: Redis,
) -> None:
    redis_conn.set("a-string", "x")
    with redis_conn.pipeline() as pipe:
        pipe.set("before", 1)
        pipe.hset("a-string", "field", 1)
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            rediswrites.replay(redis_conn, pipe)
    assert redis_conn.ping()
    with redis_conn.pipeline() as pipe:
        pipe.set("after", 1)
        rediswrites.replay(redis_conn, pipe)
    assert redis_conn.get("after") == b"1"
