"""Several Redis commands written as one atomic `EVAL`.

RQ's methods queue their writes on a pipeline; sent as a MULTI, each command
is packed, and each reply parsed, by redis-py on its own: for a consumer's
batch, dozens per job. Sent as the arguments of one `EVAL` of
`REPLAY_SCRIPT` instead, they are packed once, run atomically (as MULTI
runs them) and answered with one reply. The ingress writes its jobs this way
too (`ingress.jobs`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import ResponseError

from payhook.compat import pipeline_commands

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


def bulk(arg: bytes) -> bytes:
    """One argument in the Redis protocol (RESP): a bulk string."""
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


#: `EVAL REPLAY_SCRIPT 0`, packed.
EVAL_HEAD = b"".join(map(bulk, (b"EVAL", REPLAY_SCRIPT, b"0")))


def packed_eval(argc: int, argv: Iterable[bytes]) -> bytes:
    """`EVAL REPLAY_SCRIPT 0` with `argc` arguments, given already packed
    (each a bulk string, or several joined), as one command on the wire."""
    return b"".join([b"*%d\r\n" % (argc + 3), EVAL_HEAD, *argv])


def packed_commands(commands: Iterable[Sequence[bytes]]) -> tuple[int, bytes]:
    """Commands as `REPLAY_SCRIPT`'s arguments (each its argument count, then
    its arguments), packed: how many arguments, and their bytes."""
    parts = []
    for command in commands:
        parts.append(bulk(b"%d" % len(command)))
        parts.extend(map(bulk, command))
    return len(parts), b"".join(parts)


def replay(connection: Redis, pipeline: Pipeline) -> None:
    """Run the commands queued on `pipeline` (and not sent) as one `EVAL`
    on `connection`, atomically; the pipeline is emptied. A command Redis
    refuses raises `ResponseError`, as the pipeline's MULTI would."""
    commands = [[_encode(arg) for arg in args] for args, _options in pipeline_commands(pipeline)]
    pipeline.reset()
    if not commands:
        return
    argc, argv = packed_commands(commands)
    packed = packed_eval(argc, [argv])
    pool = connection.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command([packed])
        conn.read_response()
    except ResponseError:
        raise
    except BaseException:
        # Whatever was sent may be half-read: this connection is done.
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _encode(arg: Any) -> bytes:
    """An argument as redis-py's encoder writes it (UTF-8, numbers in decimal)."""
    kind = type(arg)
    if kind is bytes:
        return arg  # type: ignore[no-any-return]
    if kind is str:
        return arg.encode()  # type: ignore[no-any-return]
    if kind is int:
        return b"%d" % arg
    if kind is float:
        return repr(arg).encode()
    if isinstance(arg, str):  # a str enum, as RQ's statuses
        return arg.encode()
    raise TypeError(f"a Redis argument payhook does not write: {kind.__name__}")
