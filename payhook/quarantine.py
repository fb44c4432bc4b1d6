"""Jobs set aside because they cannot be read, so that consumers go on.

A job hash that RQ cannot restore (a status it does not know, a date that is
not one, a number that is not, data that would expand past what an event can
be, an id payhook never writes) would otherwise stop every consumer that
dequeues it, again and again. The consumer moves such a job here instead, in
one Lua script: its id leaves the list or registry it was found in, its hash
is renamed out of RQ's key space, and the reason is recorded beside it. RQ
never sees it again; operators do (`payhook quarantine`, the dashboard, the
`quarantined_jobs` alert), and decide.

Keys, per queue:

- `payhook:quarantine:{queue}`: sorted set of job ids, scored by when each
  was quarantined (Unix seconds);
- `payhook:quarantine:{queue}:reasons`: hash of job id to a JSON object
  (`reason`, `found_in`; when is the set's score);
- `payhook:quarantine:{queue}:job:{id}`: the job's hash as it was found.

Ids are kept as the bytes found: an id that is not UTF-8 is itself a reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from redis import Redis

#: Prefix of every quarantine key.
PREFIX = "payhook:quarantine"
#: Prefix of RQ's job hashes (`rq.job.Job.redis_job_namespace_prefix`).
JOB_PREFIX = b"rq:job:"
#: Longest reason kept, in characters; reasons name a field and a cause, never content.
MAX_REASON = 300

# KEYS: source, job hash, quarantine set, reasons hash, quarantined job hash.
# ARGV: member to remove from the source, its kind (list, zset or none),
# job id, score, reason JSON. One script: a worker killed at any point
# leaves the id either where it was or in quarantine, never neither.
_MOVE = """
if ARGV[2] == 'list' then
    redis.call('LREM', KEYS[1], 1, ARGV[1])
elseif ARGV[2] == 'zset' then
    redis.call('ZREM', KEYS[1], ARGV[1])
end
if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('RENAME', KEYS[2], KEYS[5])
    redis.call('PERSIST', KEYS[5])
end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[3], ARGV[5])
return 1
"""

# KEYS: quarantine set, reasons hash, quarantined job hash. ARGV: job id.
_PURGE = """
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
return removed
"""


@dataclass(frozen=True)
class Quarantined:
    """One quarantined job, as operators see it."""

    job_id: bytes
    at: float
    reason: str
    found_in: str

    @property
    def printable_id(self) -> str:
        """The id as text: UTF-8 where it is, escaped bytes where it is not."""
        return printable(self.job_id)

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.printable_id,
            "quarantined_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at)),
            "reason": self.reason,
            "found_in": self.found_in,
        }


def set_key(queue: str) -> str:
    return f"{PREFIX}:{queue}"


def reasons_key(queue: str) -> str:
    return f"{PREFIX}:{queue}:reasons"


def job_key(queue: str, job_id: bytes) -> bytes:
    return f"{PREFIX}:{queue}:job:".encode() + job_id


def printable(job_id: bytes) -> str:
    return job_id.decode("utf-8", "backslashreplace")


def move(
    redis: Redis,
    queue: str,
    job_id: bytes,
    reason: str,
    *,
    source: str | bytes | None = None,
    kind: str = "none",
    member: bytes | None = None,
) -> None:
    """Quarantine `job_id`, removing `member` (the id itself by default) from
    `source`, a list (`kind="list"`) or sorted set (`kind="zset"`), atomically."""
    if kind not in ("list", "zset", "none"):
        raise ValueError(f"kind: expected list, zset or none, got {kind!r}")
    now = time.time()
    found_in = source.decode("utf-8", "backslashreplace") if isinstance(source, bytes) else source
    detail = json.dumps({"reason": reason[:MAX_REASON], "found_in": found_in or ""})
    redis.eval(
        _MOVE,
        5,
        source or set_key(queue),
        JOB_PREFIX + job_id,
        set_key(queue),
        reasons_key(queue),
        job_key(queue, job_id),
        member if member is not None else job_id,
        kind,
        job_id,
        now,
        detail,
    )


def count(redis: Redis, queue: str) -> int:
    return int(redis.zcard(set_key(queue)))


def list_jobs(redis: Redis, queue: str, limit: int = 100) -> list[Quarantined]:
    """The most recently quarantined jobs first, at most `limit`."""
    entries = cast(
        list[tuple[bytes, float]],
        redis.zrevrange(set_key(queue), 0, max(0, limit - 1), withscores=True),
    )
    ids = [job_id for job_id, _ in entries]
    details = cast(list[bytes | None], redis.hmget(reasons_key(queue), ids) if ids else [])
    return [
        _entry(job_id, score, detail)
        for (job_id, score), detail in zip(entries, details, strict=True)
    ]


def show(redis: Redis, queue: str, job_id: bytes) -> tuple[Quarantined, dict[str, str]] | None:
    """One quarantined job and a safe description of its hash: each field's
    length, and the value of the short bookkeeping fields (never `data`)."""
    score = redis.zscore(set_key(queue), job_id)
    if score is None:
        return None
    entry = _entry(job_id, score, cast(bytes | None, redis.hget(reasons_key(queue), job_id)))
    fields = cast(dict[bytes, bytes], redis.hgetall(job_key(queue, job_id)))
    return entry, {printable(k): _describe(k, v) for k, v in sorted(fields.items())}


def purge(redis: Redis, queue: str, job_ids: Iterable[bytes]) -> int:
    """Delete quarantined jobs for good; how many there were."""
    purged = 0
    for job_id in job_ids:
        purged += int(
            redis.eval(
                _PURGE,
                3,
                set_key(queue),
                reasons_key(queue),
                job_key(queue, job_id),
                job_id,
            )
        )
    return purged


def all_ids(redis: Redis, queue: str) -> list[bytes]:
    return cast(list[bytes], redis.zrange(set_key(queue), 0, -1))


#: Fields shown by value in `show`: RQ's bookkeeping, short by nature.
_SHOWN = frozenset(
    {
        b"status",
        b"origin",
        b"created_at",
        b"enqueued_at",
        b"started_at",
        b"ended_at",
        b"last_heartbeat",
        b"timeout",
        b"ttl",
        b"result_ttl",
        b"failure_ttl",
        b"retries_left",
        b"number_of_retries",
    }
)
#: Longest value `show` prints, in characters.
_SHOWN_LENGTH = 64


def _describe(name: bytes, value: bytes) -> str:
    if name in _SHOWN and len(value) <= _SHOWN_LENGTH:
        return repr(value.decode("utf-8", "backslashreplace"))
    return f"({len(value)} bytes)"


def _entry(job_id: bytes, score: float, raw: bytes | None) -> Quarantined:
    try:
        detail = json.loads(raw) if raw else {}
    except ValueError:
        detail = {}
    if not isinstance(detail, dict):
        detail = {}
    return Quarantined(
        job_id=job_id,
        at=float(score),
        reason=str(detail.get("reason", "unknown")),
        found_in=str(detail.get("found_in", "")),
    )


def find(redis: Redis, queue: str, printable_id: str) -> bytes | None:
    """The quarantined id shown as `printable_id`, as `list` prints it."""
    for job_id in all_ids(redis, queue):
        if printable(job_id) == printable_id:
            return job_id
    return None
