"""What a job hash in Redis must hold before RQ may read it.

RQ's `Job.restore` trusts its hash: a status it does not know, a date or a
number that is not one, a field that is not UTF-8, raises inside RQ's
dequeue or maintenance and stops the worker; data compressed a thousandfold
expands in memory without a bound. `check_job_hash` reads every field RQ
reads the way RQ reads it, and raises `UnreadableJob` naming the first field
that fails (never its content), before RQ touches the hash. The consumer
then quarantines the job (`payhook.quarantine`) and goes on.

Fields that payhook never writes but RQ reads safely (`meta`, `webhooks`,
`result`, `description`) are left to RQ; fields payhook never writes and RQ
would act on (callbacks, dependencies, repeats, a group) are refused later,
by `PayhookJob`, when the job runs: such a job fails without retries.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Mapping

from rq.job import JobStatus
from rq.utils import str_to_date

from payhook.errors import UnreadableJob
from payhook.settings import MAX_DURATION

#: The ids payhook gives jobs: a delivery id, a UUID in its canonical form.
JOB_ID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: Bytes of a job's data beyond the event body: the function name, the
#: envelope's other fields and the signature headers, with room to spare.
ENVELOPE_ROOM = 1024 * 1024
#: Bytes of JSON one byte of body may become at worst (`\u001f`).
JSON_EXPANSION = 6
#: zlib's highest compression ratio: data shorter than the bound over this
#: cannot expand past the bound, and is not decompressed to find out.
ZLIB_MAX_RATIO = 1032
#: Highest retry count or retry list length payhook could have written.
MAX_RETRIES = 1000
#: Seconds a TTL may hold: a larger one fails Redis's EXPIRE in RQ's bookkeeping.
MAX_TTL = int(MAX_DURATION)

_STATUSES = frozenset(status.value.encode() for status in JobStatus)
_DATES = (b"created_at", b"enqueued_at", b"started_at", b"ended_at", b"last_heartbeat")
_TEXTS = (
    b"origin",
    b"worker_name",
    b"description",
    b"group_id",
    b"dependency_id",
    b"success_callback_name",
    b"failure_callback_name",
    b"stopped_callback_name",
)
_FLAGS = (b"allow_dependency_failures", b"enqueue_at_front", b"enqueue_at_front_on_retry")
_CALLBACK_TIMEOUTS = (
    b"success_callback_timeout",
    b"failure_callback_timeout",
    b"stopped_callback_timeout",
)


def data_bound(max_body: int) -> int:
    """Most bytes a job's data may expand to for bodies of at most `max_body` bytes."""
    return JSON_EXPANSION * max_body + ENVELOPE_ROOM


def check_job_id(job_id: bytes) -> str:
    """The id as text if it is one payhook writes; `UnreadableJob` if not."""
    if JOB_ID.fullmatch(job_id) is None:
        raise UnreadableJob("id: not a job id payhook writes (a UUID)")
    return job_id.decode()


def check_job_hash(fields: Mapping[bytes, bytes], max_data: int) -> None:
    """`UnreadableJob` naming the first field RQ could not read, or that holds
    data expanding past `max_data` bytes."""
    for name in fields:
        try:
            name.decode()
        except UnicodeDecodeError:
            raise UnreadableJob("a field name: not UTF-8") from None
    data = fields.get(b"data")
    if data is None:
        raise UnreadableJob("data: missing")
    _check_data(data, max_data)
    for name, check in _CHECKS:
        value = fields.get(name)
        if value:  # RQ reads an empty field as absent
            try:
                check(value)
            except (ValueError, TypeError, OverflowError, RecursionError):  # UnicodeError too
                raise UnreadableJob(f"{name.decode()}: {_WHAT[check]}") from None


def _check_data(data: bytes, max_data: int) -> None:
    if len(data) > max_data:
        raise UnreadableJob(f"data: longer than {max_data} bytes")
    if len(data) * ZLIB_MAX_RATIO <= max_data:
        return
    inflater = zlib.decompressobj()
    try:
        expanded = inflater.decompress(data, max_data + 1)
    except zlib.error:
        return  # RQ reads data that is not zlib as it is: bounded above
    if len(expanded) > max_data or inflater.unconsumed_tail:
        raise UnreadableJob(f"data: expands past {max_data} bytes")


def _status(value: bytes) -> None:
    if value not in _STATUSES:
        raise ValueError(value)


def _date(value: bytes) -> None:
    str_to_date(value.decode())


def _text(value: bytes) -> None:
    value.decode()


def _ttl(value: bytes) -> None:
    if not -1 <= int(value) <= MAX_TTL:
        raise ValueError(value)


def _count(value: bytes) -> None:
    if not 0 <= int(value) <= MAX_RETRIES:
        raise ValueError(value)


def _flag(value: bytes) -> None:
    int(value)


def _intervals(value: bytes) -> None:
    intervals = json.loads(value.decode())
    if not isinstance(intervals, list) or len(intervals) > MAX_RETRIES:
        raise ValueError(value)
    for interval in intervals:
        if isinstance(interval, bool) or not isinstance(interval, int | float):
            raise TypeError(interval)
        if not 0 <= interval <= MAX_TTL:
            raise ValueError(interval)


def _json_list(value: bytes) -> None:
    if not isinstance(json.loads(value.decode()), list):
        raise TypeError(value)


_WHAT: dict[Callable[[bytes], None], str] = {
    _status: "not a status RQ knows",
    _date: "not a date as RQ writes one",
    _text: "not UTF-8",
    _ttl: f"not a whole number from -1 to {MAX_TTL}",
    _count: f"not a whole number from 0 to {MAX_RETRIES}",
    _flag: "not a whole number",
    _intervals: "not a JSON list of retry intervals",
    _json_list: "not a JSON list",
}
_CHECKS: tuple[tuple[bytes, Callable[[bytes], None]], ...] = (
    (b"status", _status),
    *((name, _date) for name in _DATES),
    *((name, _text) for name in _TEXTS),
    # RQ reads a stored timeout with `int()`; one out of range is refused
    # when the job runs (`PayhookJob`), as payhook never writes it.
    (b"timeout", _flag),
    (b"ttl", _ttl),
    (b"result_ttl", _ttl),
    (b"failure_ttl", _ttl),
    (b"retries_left", _count),
    (b"number_of_retries", _count),
    (b"repeats_left", _count),
    (b"retry_intervals", _intervals),
    (b"dependency_ids", _json_list),
    *((name, _flag) for name in _FLAGS),
    *((name, _flag) for name in _CALLBACK_TIMEOUTS),
)
