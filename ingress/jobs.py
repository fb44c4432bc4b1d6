"""The Redis commands of one event job, as RQ writes them.

`payhook.queue.enqueue_event` stays the one definition of a job. At start the
ingress runs it against a connection that only records commands (no I/O),
keeps those commands as a template, and marks the values that change from one
job to the next: the job id, the compressed call data and two timestamps.
Each request fills them in; no RQ object is built on the request path.

A second recording, for another envelope, must come out identical to the
template rendered for that envelope, the call data compared as a worker reads
it (decompressed and parsed: the ingress serializes it with orjson and
compresses it with ISA-L, faster than RQ does; RQ's JSON serializer reads any
JSON, its worker any zlib stream); if RQ ever writes something else per job,
the ingress refuses to start rather than write jobs the workers cannot run.

On the wire, jobs are the arguments of an `EVAL` of `REPLAY_SCRIPT`, which
runs their commands atomically; one `EVAL` carries every job of a batch. A
job's share is packed once with holes for the per-job values, so a request
only formats those.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from isal import isal_zlib
from redis import Redis
from redis.client import Pipeline
from rq.serializers import JSONSerializer

from payhook.compat import assume_redis_version, pipeline_commands
from payhook.envelope import Envelope
from payhook.errors import PayhookError
from payhook.queue import APPLY_EVENT, enqueue_event, events_queue
from payhook.rediswrites import bulk, packed_commands, packed_eval
from payhook.settings import Settings

#: Hash fields RQ sets to the time of enqueueing.
TIME_FIELDS = frozenset({b"created_at", b"enqueued_at"})
#: Hash field holding the compressed, serialized call.
DATA_FIELD = b"data"
#: ISA-L level of the call data: the fastest, 3.4 µs for a 1.5 KB body
#: against 8 µs at level 1 and 12.5 µs for zlib's fastest, measured.
ISAL_LEVEL = 0

Command = list[bytes]


class JobFormatChanged(PayhookError):
    """RQ writes an event job differently than the ingress expects."""


class _RecordingPipeline(Pipeline):
    """A pipeline whose `execute` records its commands instead of sending them."""

    sink: list[Command]

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        encoder = self.connection_pool.get_encoder()
        commands = pipeline_commands(self)
        for args, _options in commands:
            # redis-py's encoder is unannotated; it turns str, int and float into bytes.
            self.sink.append([encoder.encode(arg) for arg in args])  # type: ignore[no-untyped-call]
        replies = [1] * len(commands)
        self.reset()
        return replies


class _RecordingRedis(Redis):
    """A client that never connects: pipelines record, direct commands fail."""

    def __init__(self) -> None:
        super().__init__()
        self.sink: list[Command] = []

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        pipe = _RecordingPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )
        pipe.sink = self.sink
        return pipe

    def execute_command(self, *args: Any, **options: Any) -> Any:
        raise JobFormatChanged(f"RQ sent {args[0]!r} outside a pipeline while enqueueing")


def record_commands(settings: Settings, envelope: Envelope) -> list[Command]:
    """The commands `enqueue_event` sends for `envelope`, recorded without I/O."""
    connection = _RecordingRedis()
    queue = events_queue(connection, settings)
    # RQ asks the server its version before enqueueing; nothing it writes depends on it.
    assume_redis_version(queue, (7, 0, 0))
    enqueue_event(queue, envelope, settings)
    return connection.sink


def pack_command(args: Sequence[bytes]) -> bytes:
    """One command in the Redis protocol (RESP), as an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(bulk(arg) for arg in args)


@dataclass(frozen=True)
class PackedJob:
    """One job's share of a replay `EVAL`: its ARGV entries, already in RESP."""

    argc: int
    argv: bytes


def pack_jobs(jobs: Sequence[PackedJob]) -> bytes:
    """One `EVAL` of `REPLAY_SCRIPT` that writes every job in `jobs`, atomically."""
    return packed_eval(sum(job.argc for job in jobs), (job.argv for job in jobs))


def pack_commands(commands: Sequence[Command]) -> PackedJob:
    """The ARGV share of a job given as plain commands."""
    return PackedJob(*packed_commands(commands))


def call_data(envelope: Envelope) -> bytes:
    """The `data` field of the job: the call as JSON, which RQ's JSONSerializer reads.

    Serialized by orjson, over ten times faster than `json` for a job of this
    size, and compressed by ISA-L (`isal_zlib`) rather than `zlib`: the same
    zlib stream format, which a worker's `zlib.decompress` reads. Compression
    is the largest single cost of this request path; ISA-L's level 0 takes a
    quarter of the CPU of zlib's level 1. With the body as text (envelope
    version 2) a job takes as much Redis memory as zlib's level 1 over a
    base64 body did: 3,181 bytes against 3,174 for a 1.5 KB event, measured
    with `used_memory` (level 1: 2,797 bytes, for 4.6 µs more per request).
    """
    call: tuple[str, None, tuple[dict[str, Any]], dict[str, Any]] = (
        APPLY_EVENT,
        None,
        (envelope.to_json(),),
        {},
    )
    return isal_zlib.compress(orjson.dumps(call), ISAL_LEVEL)


@dataclass(frozen=True)
class _Slot:
    """A value that changes per job."""

    kind: str  # "id", "data" or "time"
    #: For "id": the text around the probe's id, where the new id goes.
    parts: tuple[bytes, ...] = ()
    #: For "time": the hash field it belongs to.
    field: bytes = b""


Arg = bytes | _Slot


class JobTemplate:
    """RQ's commands for one event job, with slots for what changes per job."""

    def __init__(self, commands: Sequence[Sequence[Arg]], queue_key: bytes) -> None:
        self._commands = [list(command) for command in commands]
        #: The Redis list the consumers pop from.
        self.queue_key = queue_key
        # The job's ARGV share, packed: runs of constant bytes and the slots between.
        frame: list[Arg] = [b""]
        self._argc = 0
        for command in self._commands:
            for arg in [b"%d" % len(command), *command]:
                self._argc += 1
                if isinstance(arg, _Slot):
                    frame.append(arg)
                elif isinstance(frame[-1], bytes):
                    frame[-1] += bulk(arg)
                else:
                    frame.append(bulk(arg))
        #: Constant parts as they are, slots as b"" to be filled in.
        self._parts = [part if isinstance(part, bytes) else b"" for part in frame]
        self._slot_at = [(i, part) for i, part in enumerate(frame) if isinstance(part, _Slot)]

    @classmethod
    def from_rq(cls, settings: Settings) -> JobTemplate:
        """Record the job RQ writes, and prove the template reproduces a second one."""
        probe = _probe_envelope(1)
        template = cls(_slots(record_commands(settings, probe), probe), _queue_key(settings))
        check = _probe_envelope(2)
        recorded = record_commands(settings, check)
        times = _times(recorded)
        rendered = template.render(check, times)
        if as_read(rendered) != as_read(recorded):
            raise JobFormatChanged(
                "the job recorded from RQ differs from the template in more than its id, "
                "data and timestamps; update ingress.jobs for this RQ version"
            )
        if template.pack(check, times) != pack_commands(rendered):
            raise JobFormatChanged("the packed template differs from its commands")
        return template

    def packed(self, envelope: Envelope) -> PackedJob:
        """The job that enqueues `envelope` now, ready for `pack_jobs`."""
        stamp = rq_time(datetime.now(UTC))
        return self.pack(envelope, {field: stamp for field in TIME_FIELDS})

    def pack(self, envelope: Envelope, times: dict[bytes, bytes]) -> PackedJob:
        fill = self._filler(envelope, times)
        parts = self._parts.copy()
        for index, slot in self._slot_at:
            parts[index] = bulk(fill(slot))
        return PackedJob(self._argc, b"".join(parts))

    def render(self, envelope: Envelope, times: dict[bytes, bytes]) -> list[Command]:
        """The job's commands for `envelope`, unpacked (for checks and tests)."""
        fill = self._filler(envelope, times)
        return [
            [arg if isinstance(arg, bytes) else fill(arg) for arg in command]
            for command in self._commands
        ]

    def _filler(self, envelope: Envelope, times: dict[bytes, bytes]) -> Callable[[_Slot], bytes]:
        job_id = envelope.delivery_id.encode()
        data = call_data(envelope)

        def fill(slot: _Slot) -> bytes:
            if slot.kind == "id":
                return job_id.join(slot.parts)
            if slot.kind == "data":
                return data
            return times[slot.field]

        return fill


def _slots(commands: list[Command], probe: Envelope) -> list[list[Arg]]:
    probe_id = probe.delivery_id.encode()
    result: list[list[Arg]] = []
    for command in commands:
        args: list[Arg] = []
        for index, arg in enumerate(command):
            field = command[index - 1] if _is_hash_value(command, index) else None
            if field in TIME_FIELDS:
                args.append(_Slot("time", field=field))
            elif field == DATA_FIELD:
                args.append(_Slot("data"))
            elif probe_id in arg:
                args.append(_Slot("id", parts=tuple(arg.split(probe_id))))
            else:
                args.append(arg)
        result.append(args)
    if not any(isinstance(arg, _Slot) and arg.kind == "data" for cmd in result for arg in cmd):
        raise JobFormatChanged("RQ wrote no data field for the event job")
    return result


def _is_hash_value(command: Command, index: int) -> bool:
    """Whether `command[index]` is a value in `HSET key field value [field value ...]`."""
    return command[0].upper() == b"HSET" and index >= 3 and index % 2 == 1


def rq_time(moment: datetime) -> bytes:
    """`moment` (UTC) as RQ's `utcformat` writes it, `2026-01-31T09:05:00.000000Z`, faster."""
    return moment.isoformat(timespec="microseconds").removesuffix("+00:00").encode() + b"Z"


def as_read(commands: Sequence[Command]) -> list[list[Any]]:
    """The commands with the call data as a worker reads it: decompressed, deserialized."""
    return [
        [
            # RQ's serializer is unannotated; it returns the call as a list.
            JSONSerializer.loads(zlib.decompress(arg))
            if _is_hash_value(command, i) and command[i - 1] == DATA_FIELD
            else arg
            for i, arg in enumerate(command)
        ]
        for command in commands
    ]


def _times(commands: list[Command]) -> dict[bytes, bytes]:
    times: dict[bytes, bytes] = {}
    for command in commands:
        for index, arg in enumerate(command):
            if _is_hash_value(command, index) and command[index - 1] in TIME_FIELDS:
                times[command[index - 1]] = arg
    return times


def _queue_key(settings: Settings) -> bytes:
    key = events_queue(_RecordingRedis(), settings).key
    return key.encode() if isinstance(key, str) else bytes(key)


def _probe_envelope(number: int) -> Envelope:
    body = b'{"probe": %d}' % number
    return Envelope(
        endpoint_id=f"00000000-0000-4000-8000-{number:012d}",
        body=body,
        headers={"webhook-id": f"probe_{number}", "x-probe": base64.b64encode(body).decode()},
        received_at=datetime(2000, 1, number, tzinfo=UTC),
        delivery_id=f"00000000-0000-4000-9000-{number:012d}",
    )
