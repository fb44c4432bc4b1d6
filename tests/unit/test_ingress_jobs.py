"""The event job the ingress writes is the one `enqueue_event` writes."""

from __future__ import annotations

import uuid
import zlib
from datetime import UTC, datetime
from typing import Any

import pytest
from redis.connection import Connection
from rq import Queue
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from ingress import jobs
from ingress.jobs import (
    JobFormatChanged,
    JobTemplate,
    pack_command,
    pack_commands,
    pack_jobs,
    record_commands,
    rq_time,
)
from payhook.envelope import Envelope
from payhook.rediswrites import REPLAY_SCRIPT
from payhook.settings import Settings

SETTINGS = Settings.from_env({"PAYHOOK_QUEUE": "unit-events", "PAYHOOK_JOB_TIMEOUT": "45"})


def envelope(body: bytes = b'{"type": "payment.succeeded"}') -> Envelope:
    return Envelope(
        endpoint_id=str(uuid.uuid4()),
        body=body,
        headers={"webhook-id": "msg_1", "webhook-timestamp": "1", "webhook-signature": "v1,x"},
        received_at=datetime.now(UTC),
        delivery_id=str(uuid.uuid4()),
    )


def as_read(commands: list[list[bytes]]) -> list[list[Any]]:
    """The commands with the job's call data as a worker reads it."""
    out: list[list[Any]] = []
    for command in commands:
        args: list[Any] = list(command)
        if args[0] == b"HSET" and b"data" in args[2::2]:
            index = args.index(b"data", 2) + 1
            args[index] = JSONSerializer.loads(zlib.decompress(args[index]))
        out.append(args)
    return out


def times(commands: list[list[bytes]]) -> dict[bytes, bytes]:
    mapping = commands[2][2:]
    fields = dict(zip(mapping[::2], mapping[1::2], strict=True))
    return {name: fields[name] for name in (b"created_at", b"enqueued_at")}


def test_template_renders_the_commands_enqueue_event_sends() -> None:
    template = JobTemplate.from_rq(SETTINGS)
    event = envelope(b'{"id": "evt_1", "amount": 1999}' * 20)
    recorded = record_commands(SETTINGS, event)
    rendered = template.render(event, times(recorded))
    assert as_read(rendered) == as_read(recorded)
    # The job names its id, the queue and the retry policy of payhook.queue.
    flat = b" ".join(arg for command in recorded for arg in command)
    assert event.delivery_id.encode() in flat
    assert b"rq:queue:unit-events" in flat
    assert str(list(SETTINGS.job_retry_intervals)).encode() in flat
    assert template.queue_key == b"rq:queue:unit-events"
    # Finished jobs leave Redis after PAYHOOK_RESULT_TTL, failed ones after 30 days.
    fields = {
        field: value
        for command in recorded
        if command[0] == b"HSET"
        for field, value in zip(command[2::2], command[3::2], strict=True)
    }
    assert fields[b"result_ttl"] == b"600" and fields[b"failure_ttl"] == b"2592000"


def test_packed_job_is_what_redis_py_would_send() -> None:
    template = JobTemplate.from_rq(SETTINGS)
    event = envelope()
    stamps = {b"created_at": b"2026-01-01T00:00:00.000000Z"} | {
        b"enqueued_at": b"2026-01-01T00:00:00.000001Z"
    }
    commands = template.render(event, stamps)
    packed = template.pack(event, stamps)
    assert packed == pack_commands(commands)
    args: list[Any] = [b"EVAL", REPLAY_SCRIPT, b"0"]
    for command in commands:
        args += [str(len(command)).encode(), *command]
    expected = b"".join(Connection().pack_command(*args))
    assert pack_jobs([packed]) == expected == pack_command(args)


def test_one_eval_carries_every_job_of_a_batch() -> None:
    first, second = pack_commands([[b"SET", b"a", b"1"]]), pack_commands([[b"RPUSH", b"q", b"x"]])
    expected = pack_command(
        [b"EVAL", REPLAY_SCRIPT, b"0", b"3", b"SET", b"a", b"1", b"3", b"RPUSH", b"q", b"x"]
    )
    assert pack_jobs([first, second]) == expected


def test_each_job_gets_its_own_id_and_data() -> None:
    template = JobTemplate.from_rq(SETTINGS)
    one, two = envelope(b"one"), envelope(b"two")
    assert template.packed(one).argv != template.packed(two).argv
    assert one.delivery_id.encode() in template.packed(one).argv
    assert two.delivery_id.encode() not in template.packed(one).argv


def test_a_job_format_with_other_per_job_values_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If RQ wrote a value the template does not fill in, the ingress must not start."""

    def enqueue_with_nonce(queue: Queue, event: Envelope, settings: Settings) -> Any:
        return queue.enqueue(
            "consumer.jobs.apply_event",
            event.to_json(),
            job_id=event.delivery_id,
            meta={"nonce": uuid.uuid4().hex},
        )

    monkeypatch.setattr(jobs, "enqueue_event", enqueue_with_nonce)
    with pytest.raises(JobFormatChanged):
        JobTemplate.from_rq(SETTINGS)


def test_recording_connection_refuses_commands_outside_a_pipeline() -> None:
    with pytest.raises(JobFormatChanged):
        jobs._RecordingRedis().get("anything")


def test_recording_needs_no_redis() -> None:
    """The URL points nowhere: recording sends nothing."""
    nowhere = Settings.from_env({"REDIS_URL": "redis://192.0.2.1:1/0"})
    commands = record_commands(nowhere, envelope())
    assert [command[0] for command in commands] == [b"SADD", b"HSET", b"HSET", b"RPUSH"]


@pytest.mark.parametrize(
    "moment",
    [
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(2026, 6, 1, 0, 0, 0, 7, tzinfo=UTC),
    ],
)
def test_timestamps_are_written_as_rq_writes_them(moment: datetime) -> None:
    assert rq_time(moment) == utcformat(moment).encode()


def test_call_data_reads_back_as_the_envelope_through_rqs_serializer() -> None:
    """orjson writes the call, RQ's JSONSerializer reads it: any body bytes, any header text."""
    event = Envelope(
        endpoint_id=str(uuid.uuid4()),
        body=bytes(range(256)) + "é€".encode(),
        headers={"webhook-id": "msg_é", "webhook-signature": "v1,\x7f\xff"},
        received_at=datetime.now(UTC),
        delivery_id=str(uuid.uuid4()),
    )
    func, instance, args, kwargs = JSONSerializer.loads(zlib.decompress(jobs.call_data(event)))
    assert (func, instance, kwargs) == ("consumer.jobs.apply_event", None, {})
    assert Envelope.from_json(args[0]) == event
