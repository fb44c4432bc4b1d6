"""Operator commands: trace an event, work the exceptions, read anomalies, the dead letters.

    payhook trace EVENT_ID --tenant T           receipt, order, transition, outbox, exceptions
    payhook exceptions list [--all] [--kind K]  one JSON object per exception, newest first
    payhook exceptions replay ID [--dry-run]    re-apply the event once its cause is fixed
    payhook exceptions resolve ID               close one without applying it
    payhook anomalies list [--kind K]           one JSON object per anomaly, newest first
    payhook dlq list                            event jobs in the dead-letter queue
    payhook dlq requeue JOB_ID... | --all       put dead-letter jobs back on the events queue

A dead-letter job is requeued with the JSON serializer and a fresh retry
budget, and only when it is an `apply_event` job of the events queue: nothing
else is ever put in front of a consumer. It leaves the dead-letter queue and
joins the events queue in one Redis script.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TextIO

import psycopg
from redis import Redis
from redis.exceptions import RedisError
from rq import Queue
from rq.exceptions import DeserializationError, NoSuchJobError
from rq.job import Job, JobStatus, parse_job_id
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from control import actions, audit
from payhook.db import Row, connect, fetch_all, fetch_one, tenant_transaction, tolerant_cursor
from payhook.errors import NotFound, PayhookError
from payhook.gateways.storable import character_problem, storable_event_id
from payhook.queue import APPLY_EVENT, ReadableJob, events_queue, redis_connection
from payhook.settings import Settings, parse_duration

#: Most rows a list command prints at once.
MAX_LIST_LIMIT = 10_000
#: Reads of one job to requeue while its hash keeps being rewritten.
REQUEUE_ATTEMPTS = 10


class NotRequeueable(PayhookError):
    """The job is not a dead-letter event job of this queue."""


@dataclass
class Trace:
    """Everything payhook recorded about one event of one tenant."""

    tenant_id: str
    event_id: str
    receipt: Row | None = None
    order: Row | None = None
    transitions: list[Row] = field(default_factory=list)
    outbox: list[Row] = field(default_factory=list)
    exceptions: list[Row] = field(default_factory=list)
    anomalies: list[Row] = field(default_factory=list)
    #: What operators did about the event (`payhook.operator_actions`).
    actions: list[Row] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return self.receipt is not None or bool(self.anomalies)


def trace_event(conn: psycopg.Connection[Row], tenant_id: str, event_id: str) -> Trace:
    """What payhook recorded about `event_id`: the id as stored, or the
    gateway's id of an event stored under a digest of it.

    Whatever was stored is shown: a time Python cannot hold is its text.
    """
    tenant = _uuid(tenant_id, "--tenant")
    with tenant_transaction(conn, tenant), tolerant_cursor(conn) as cur:
        ids = _stored_ids(event_id)
        key = {"tenant_id": tenant, "event_id": ids[0]}
        receipt = None
        for stored in ids:
            receipt = fetch_one(cur, "trace_receipt", key | {"event_id": stored})
            if receipt is not None:
                key["event_id"] = stored
                break
        trace = Trace(tenant_id=tenant, event_id=key["event_id"], receipt=receipt)
        trace.transitions = fetch_all(cur, "trace_transitions", key)
        order_id = trace.receipt["order_id"] if trace.receipt else None
        if order_id is None and trace.transitions:
            order_id = trace.transitions[0]["order_id"]
        if order_id is not None:
            trace.order = fetch_one(cur, "trace_order", {"tenant_id": tenant, "order_id": order_id})
        trace.outbox = fetch_all(cur, "trace_outbox", key)
        trace.exceptions = fetch_all(cur, "trace_exceptions", key)
        trace.anomalies = fetch_all(cur, "trace_anomalies", key)
        trace.actions = fetch_all(cur, "list_operator_actions", key | {"limit": MAX_LIST_LIMIT})
    return trace


def _stored_ids(event_id: str) -> list[str]:
    """The ids an event named `event_id` may be stored under: that one, if
    PostgreSQL can hold it, then the one a gateway's id maps to."""
    ids = [event_id] if character_problem(event_id) is None else []
    if storable_event_id(event_id) != event_id:
        ids.append(storable_event_id(event_id))
    return ids


def format_trace(trace: Trace) -> str:
    """The trace as aligned lines, receipt first, delivery last."""
    lines = [f"event {trace.event_id}  tenant {trace.tenant_id}"]

    def add(label: str, text: str) -> None:
        lines.append(f"  {label:<11} {text}")

    r = trace.receipt
    if r is None:
        add("receipt", "none: payhook has no record of this event for this tenant")
    elif r["archived_at"] is not None:
        add(
            "receipt",
            f"archived={_when(r['archived_at'])}  outcome={r['outcome']}  "
            f"received={_when(r['received_at'])}  processed={_when(r['processed_at'])}  "
            "(retention keeps the identity, digest and outcome; a redelivery is a duplicate)",
        )
    else:
        add(
            "receipt",
            f"{r['event_type']}  outcome={r['outcome']}  gateway={r['gateway']}  "
            f"received={_when(r['received_at'])}  processed={_when(r['processed_at'])}  "
            f"delivery={r['delivery_id']}",
        )
    o = trace.order
    if o is not None:
        add(
            "order",
            f"{o['id']}  ref={o['merchant_reference']}  gateway_order={o['gateway_order_id']}  "
            f"{o['amount_minor']} {o['currency']}  state={o['state']}"
            + (f"  refunded={o['refunded_minor']}" if o["refunded_minor"] else ""),
        )
    for t in trace.transitions:
        add(
            "transition",
            f"{t['from_state']} -> {t['to_state']}  amount={t['amount_minor']}  "
            f"at={_when(t['created_at'])}",
        )
    for x in trace.outbox:
        delivery = (
            f"delivered={_when(x['delivered_at'])}"
            if x["delivered_at"]
            else f"next_attempt={_when(x['next_attempt_at'])}"
        )
        add(
            "outbox",
            f"{x['action']}  state={x['state']}  attempts={x['attempts']}  {delivery}"
            + (f"  last_error={x['last_error']}" if x["last_error"] else ""),
        )
    for e in trace.exceptions:
        status = f"resolved={_when(e['resolved_at'])}" if e["resolved_at"] else "open"
        add("exception", f"#{e['id']} {e['kind']}  {status}  detail={json.dumps(e['detail'])}")
    for a in trace.anomalies:
        add("anomaly", f"#{a['id']} {a['kind']}  at={_when(a['detected_at'])}")
    for act in reversed(trace.actions):  # oldest first, as the lines above
        note = f"  note={json.dumps(act['note'])}" if act["note"] else ""
        add(
            "operator",
            f"{act['action']} {act['object_kind']} {act['object_id']}  by={act['actor']} "
            f"({act['source']})  at={_when(act['at'])}{note}",
        )
    if r is not None and not trace.transitions and not trace.exceptions:
        add("effect", "none (duplicate, ignored or already applied)")
    return "\n".join(lines)


def list_exceptions(
    conn: psycopg.Connection[Row],
    *,
    include_resolved: bool = False,
    kind: str | None = None,
    tenant_id: str | None = None,
    limit: int = 50,
) -> list[Row]:
    """Newest first; of one tenant, or of every tenant (an audited path)."""
    params = {"include_resolved": include_resolved, "kind": kind, "limit": _limit(limit)}
    if tenant_id is None:
        return fetch_all(conn, "list_every_tenants_exceptions", params)
    tenant = _uuid(tenant_id, "--tenant")
    with tenant_transaction(conn, tenant):
        return fetch_all(conn, "list_exceptions", params | {"tenant_id": tenant})


def list_anomalies(
    conn: psycopg.Connection[Row],
    *,
    kind: str | None = None,
    since: float | None = None,
    limit: int = 50,
) -> list[Row]:
    """Newest first, of every tenant and of none (an audited path)."""
    return fetch_all(conn, "list_anomalies", {"kind": kind, "since": since, "limit": _limit(limit)})


def list_dead_letters(redis: Redis, settings: Settings, limit: int = 50) -> list[dict[str, Any]]:
    """The dead-letter queue's jobs, oldest failure first, without their payloads."""
    registry = FailedJobRegistry(queue=events_queue(redis, settings))
    ids = registry.get_job_ids(0, _limit(limit) - 1, cleanup=False)
    jobs: list[dict[str, Any]] = []
    for job_id in ids:
        try:
            job = fetch_job(redis, job_id)
        except NotFound:
            continue
        except NotRequeueable as exc:
            jobs.append(
                {
                    "id": job_id,
                    "function": None,
                    "description": None,
                    "enqueued_at": None,
                    "ended_at": None,
                    "error": f"unreadable job: {exc}",
                }
            )
            continue
        error = (latest_error(job) or "").strip().splitlines()
        jobs.append(
            {
                "id": job.id,
                "function": job.func_name if _readable(job) else None,
                "description": job.description,
                "enqueued_at": job.enqueued_at,
                "ended_at": job.ended_at,
                "error": error[-1] if error else None,
            }
        )
    return jobs


def latest_error(job: Job) -> str | None:
    """The traceback stored with `job`'s latest result; None if it has none.

    RQ decodes the stored result (base64, zlib, the serializer) when it is
    read: a damaged or forged result reads as `unreadable result: <error type>`
    instead of raising, so that one such job does not hide the others.
    """
    try:
        result = job.latest_result()
    except RedisError:
        raise
    except Exception as exc:  # whatever a malformed result entry raises in RQ
        kind = type(exc)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
        return f"unreadable result: {name}"
    return result.exc_string if result else None


def requeue_dead_letter(redis: Redis, settings: Settings, job_id: str) -> Job:
    """Move one dead-letter job back onto the events queue with a fresh retry budget."""
    queue = events_queue(redis, settings)
    registry = FailedJobRegistry(queue=queue)
    intervals = list(settings.job_retry_intervals)
    for _ in range(REQUEUE_ATTEMPTS):
        job, stored = _read_job(redis, job_id)
        if job.origin != queue.name:
            raise NotRequeueable(
                f"job {job_id} belongs to queue {job.origin!r}, not {queue.name!r}"
            )
        if not _readable(job) or job.func_name != APPLY_EVENT:
            raise NotRequeueable(f"job {job_id} is not a payhook event job; it is never requeued")
        if _requeue(registry, queue, job, stored, intervals):
            return job
    raise NotRequeueable(f"job {job_id} kept changing while it was requeued; try again")


def fetch_job(redis: Redis, job_id: str) -> Job:
    """The job `job_id`: `NotFound` if there is none, `NotRequeueable` if RQ
    cannot read its hash (forged or damaged: one such job must not stop an
    operator from listing or requeuing the others)."""
    return _read_job(redis, job_id)[0]


def _read_job(redis: Redis, job_id: str) -> tuple[Job, dict[bytes, bytes]]:
    """The job `job_id` and the hash it was restored from, read in one command;
    raises as `fetch_job` says."""
    try:
        # Checked before RQ reads it: data that would expand past what an
        # event can be is never expanded (`payhook.jobhash`).
        job = ReadableJob(parse_job_id(job_id), connection=redis, serializer=JSONSerializer)
    except (TypeError, ValueError) as exc:
        raise NotRequeueable(f"job {job_id} cannot be read ({exc})") from None
    stored: dict[bytes, bytes] = redis.hgetall(job.key)  # type: ignore[assignment]
    if not stored:
        raise NotFound(f"no job {job_id}")
    try:
        job.restore(stored)
    except RedisError:
        raise
    except NoSuchJobError as exc:
        raise NotRequeueable(f"job {job_id} cannot be read: {exc}") from None
    except Exception as exc:  # whatever a malformed field raises in RQ
        raise NotRequeueable(
            f"job {job_id} cannot be read ({exc.__class__.__name__}: {exc})"
        ) from None
    return job, stored


#: Moves one job id from a dead-letter queue (FailedJobRegistry) onto its RQ
#: queue, with the job's hash marked queued, or does nothing and says why.
#: KEYS: registry, queue, job hash, RQ's set of queues. ARGV: the job id, the
#: number of fields of its hash as read and checked, those fields and values,
#: then the field/value pairs to write. Redis rolls back neither a transaction
#: nor a script whose command fails, so every key is checked before the first
#: write and no write can fail after another succeeded; the id leaves the
#: registry last. The shebang makes Redis refuse the whole script up front
#: when it is out of memory.
REQUEUE_SCRIPT = """#!lua
local registry, queue, job, queues = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, n = ARGV[1], tonumber(ARGV[2])
if redis.call('TYPE', registry).ok ~= 'zset' or not redis.call('ZSCORE', registry, id) then
  return 'absent'
end
if redis.call('TYPE', job).ok ~= 'hash' or redis.call('HLEN', job) ~= n then
  return 'changed'
end
for i = 3, 2 + 2 * n, 2 do
  if redis.call('HGET', job, ARGV[i]) ~= ARGV[i + 1] then
    return 'changed'
  end
end
local kind = redis.call('TYPE', queue).ok
if kind ~= 'list' and kind ~= 'none' then
  return 'queue is not a list'
end
kind = redis.call('TYPE', queues).ok
if kind ~= 'set' and kind ~= 'none' then
  return 'set of queues is not a set'
end
redis.call('HSET', job, unpack(ARGV, 3 + 2 * n))
redis.call('PERSIST', job)
redis.call('SADD', queues, queue)
redis.call('RPUSH', queue, id)
redis.call('ZREM', registry, id)
return 'requeued'
"""


def _requeue(
    registry: FailedJobRegistry,
    queue: Queue,
    job: Job,
    stored: dict[bytes, bytes],
    intervals: list[int],
) -> bool:
    """Take `job` out of the registry and put it on `queue` in one Redis script;
    False when its hash is no longer `stored`, the hash it was read from (read
    and check it again).

    RQ's `FailedJobRegistry.requeue` removes the job from the registry, then
    enqueues it, in two round trips. Enqueueing with RQ inside one MULTI/EXEC
    is not enough either: Redis runs a transaction's commands one by one and
    keeps those that succeeded when one fails, and RQ's `enqueue_job` leaves a
    job whose hash says "deferred" off the queue. Here the script checks
    everything before it writes, pushes the id whatever the hash says, and
    takes it out of the registry only then: the only copy of an acknowledged
    event is in one of the two, whenever a connection or process dies, and
    two requeues of one job (two operators, a double click) put it on the
    queue once. The hash moved is the one read and checked, field for field,
    so a hash rewritten meanwhile, or made unreadable, is never moved; it is
    not rewritten from what RQ read either (a field RQ could not write back
    would stop the move): only the fields a requeue changes are written.
    """
    fields: dict[str, str | int] = {
        "status": JobStatus.QUEUED.value,
        "enqueued_at": utcformat(now()),
        "started_at": "",
        "ended_at": "",
        "retries_left": len(intervals),
        "retry_intervals": json.dumps(intervals),
    }
    move = registry.connection.register_script(REQUEUE_SCRIPT)
    answer = move(
        keys=[registry.key, queue.key, job.key, queue.redis_queues_keys],
        args=[
            job.id,
            len(stored),
            *(part for pair in stored.items() for part in pair),
            *(part for pair in fields.items() for part in pair),
        ],
    )
    outcome = answer.decode() if isinstance(answer, bytes) else str(answer)
    if outcome == "requeued":
        job.retries_left = len(intervals)
        job.retry_intervals = intervals
        return True
    if outcome == "changed":
        return False
    if outcome == "absent":
        raise NotRequeueable(f"job {job.id} is not in the dead-letter queue")
    raise NotRequeueable(f"job {job.id} is left in the dead-letter queue: its {outcome}")


def requeue_all_dead_letters(redis: Redis, settings: Settings) -> tuple[list[str], list[str]]:
    """Requeue every dead-letter event job, one atomic move each; the ids requeued
    and the ids refused. Stopped anywhere, it leaves each job in the dead-letter
    queue or on the events queue."""
    registry = FailedJobRegistry(queue=events_queue(redis, settings))
    requeued: list[str] = []
    refused: list[str] = []
    for job_id in registry.get_job_ids(cleanup=False):
        try:
            requeue_dead_letter(redis, settings, job_id)
        except (NotFound, NotRequeueable):
            refused.append(job_id)
        else:
            requeued.append(job_id)
    return requeued, refused


def run(args: argparse.Namespace, settings: Settings, out: TextIO = sys.stdout) -> int:
    """The `trace`, `exceptions`, `anomalies` and `dlq` commands."""
    if args.command == "dlq":
        return _run_dlq(args, settings, out)
    with connect(settings, "operations") as conn:
        if args.command == "trace":
            trace = trace_event(conn, args.tenant, args.event_id)
            if args.json:
                _print_json(out, trace.__dict__)
            else:
                print(format_trace(trace), file=out)
            return 0 if trace.found else 1
        if args.command == "anomalies":
            since = parse_duration("--since", args.since) if args.since else None
            _print_rows(out, list_anomalies(conn, kind=args.kind, since=since, limit=args.limit))
            return 0
        if args.action == "list":
            rows = list_exceptions(
                conn,
                include_resolved=args.all,
                kind=args.kind,
                tenant_id=args.tenant,
                limit=args.limit,
            )
            _print_rows(out, rows)
            return 0
        tenant = _uuid(args.tenant, "--tenant") if args.tenant else None
        if args.action == "replay":
            replay = actions.replay_exception(conn, args.id, tenant_id=tenant, dry_run=args.dry_run)
            _print_json(out, replay.to_json())
            return 0 if replay.resolved else 1
        if args.action == "resolve":
            note = args.note or ""
            closed = actions.resolve_exception(conn, args.id, tenant_id=tenant, note=note)
            _print_json(out, {"exception_id": args.id, "resolved": True, "changed": closed})
            return 0
    raise PayhookError(f"unknown command {args.command} {getattr(args, 'action', '')}".strip())


def _run_dlq(args: argparse.Namespace, settings: Settings, out: TextIO) -> int:
    redis = redis_connection(settings, timeout=10)
    try:
        if args.action == "list":
            _print_rows(out, list_dead_letters(redis, settings, args.limit))
            return 0
        if args.all:
            requeued, refused = requeue_all_dead_letters(redis, settings)
            record_requeues(settings, requeued)
            _print_json(out, {"requeued": requeued, "refused": refused})
            return 0 if not refused else 1
        if not args.job_ids:
            raise PayhookError("dlq requeue: name one or more job ids, or --all")
        failed = 0
        for job_id in args.job_ids:
            try:
                requeue_dead_letter(redis, settings, job_id)
            except (NotFound, NotRequeueable) as exc:
                failed += 1
                _print_json(out, {"id": job_id, "requeued": False, "reason": str(exc)})
            else:
                record_requeues(settings, [job_id])
                _print_json(out, {"id": job_id, "requeued": True})
        return 1 if failed else 0
    finally:
        redis.close()


def record_requeues(settings: Settings, job_ids: list[str], **options: Any) -> None:
    """One audit row per requeued dead letter (a job of no tenant yet known),
    written once the requeue took effect in Redis."""
    if not job_ids:
        return
    with connect(settings, "operations") as conn:
        for job_id in job_ids:
            audit.record(conn, "dlq_requeue", "job", job_id, **options)


def _readable(job: Job) -> bool:
    try:
        job.func_name  # noqa: B018 - deserializes the call data, JSON only
    except DeserializationError:
        return False
    return True


def _print_rows(out: TextIO, rows: Iterable[dict[str, Any]]) -> None:
    for row in rows:
        _print_json(out, row)


def _print_json(out: TextIO, value: Any) -> None:
    print(json.dumps(value, default=_json_value), file=out)


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _when(value: datetime | str | None) -> str:
    """A time as the trace shows it; one Python cannot hold arrives as PostgreSQL's text."""
    if isinstance(value, datetime):
        return value.isoformat(timespec="seconds")
    return value or "-"


def _limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise PayhookError(f"--limit: expected 1 to {MAX_LIST_LIMIT}, got {limit}")
    return limit


def _uuid(value: str, name: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise PayhookError(f"{name}: expected a UUID, got {value!r}") from None
