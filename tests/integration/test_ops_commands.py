"""Operator commands: trace, exceptions list, anomalies list, dead-letter requeue."""

from __future__ import annotations

import io
import json
import pickle
import socket
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
from redis import Redis
from redis.connection import Connection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.typing import EncodableT, FieldT
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from consumer.handler import Runtime
from consumer.main import build_worker
from consumer.transaction import apply_event
from consumer.worker import PayhookJob, PayhookWorker
from control import operations
from control.cli import build_parser
from control.operations import NotRequeueable, requeue_dead_letter
from payhook.db import Row, create_pool
from payhook.endpoints import Endpoint
from payhook.gateways import get_gateway
from payhook.jobhash import data_bound
from payhook.queue import APPLY_EVENT, enqueue_event, events_queue
from payhook.settings import Settings
from tests.conftest import PG_SERVER
from tests.factories import Factory, Shop, StandardEvent
from tests.processes import run_cli


def run(settings: Settings, *argv: str) -> tuple[int, str]:
    """A command as the CLI parses it; its exit status and output."""
    args = build_parser().parse_args(list(argv))
    out = io.StringIO()
    return operations.run(args, settings, out=out), out.getvalue()


def deliver(conn: psycopg.Connection[Row], shop: Shop, event: StandardEvent) -> str:
    body = event.body()
    parsed = get_gateway("standard").parse(event.headers(shop.secret, body), body)
    endpoint = Endpoint(shop.endpoint_id, shop.tenant_id, "standard", (shop.secret,))
    return apply_event(conn, endpoint, parsed, str(uuid.uuid4())).outcome


def lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines()]


def test_trace_shows_receipt_order_transition_and_outbox(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent()
    assert deliver(conn, shop, event) == "applied"

    status, text = run(settings, "trace", event.event_id, "--tenant", shop.tenant_id)
    assert status == 0
    rows = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "payment.succeeded" in rows["receipt"] and "outcome=applied" in rows["receipt"]
    assert order_id in rows["order"] and "state=paid" in rows["order"]
    assert "pending -> paid" in rows["transition"]
    assert "fulfil_order" in rows["outbox"] and "state=pending" in rows["outbox"]
    assert "attempts=0" in rows["outbox"]

    status, text = run(settings, "trace", event.event_id, "--tenant", shop.tenant_id, "--json")
    trace = json.loads(text)
    assert trace["receipt"]["outcome"] == "applied"
    assert [t["to_state"] for t in trace["transitions"]] == ["paid"]
    assert [o["action"] for o in trace["outbox"]] == ["fulfil_order"]

    status, text = run(settings, "trace", "msg_never_sent", "--tenant", shop.tenant_id)
    assert status == 1 and "no record" in text


@pytest.mark.parametrize("timezone_name", ["UTC", "Pacific/Kiritimati", "America/New_York"])
def test_trace_shows_times_python_cannot_hold(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings, timezone_name: str
) -> None:
    """Receipts stored before times were bounded: a payment dated past year
    9999 in UTC, an archived receipt of year 1; whatever the session's zone."""
    shop = factory.shop()
    conn.execute(f"SET timezone = '{timezone_name}'")
    receipt = {
        "tenant_id": shop.tenant_id,
        "endpoint_id": shop.endpoint_id,
        "delivery_id": str(uuid.uuid4()),
    }
    conn.execute(
        "INSERT INTO payhook.payment_event_receipts (tenant_id, event_id, event_type,"
        " payload_sha256, endpoint_id, gateway, delivery_id, occurred_at, processed_at, outcome)"
        " VALUES (%(tenant_id)s, 'msg_far', 'payment.succeeded', repeat('a', 64),"
        " %(endpoint_id)s, 'standard', %(delivery_id)s, '10000-01-01 13:59:59+00',"
        " 'infinity', 'ignored')",
        receipt,
    )
    conn.execute(
        "INSERT INTO payhook.payment_event_receipts_archive (tenant_id, event_id, outcome,"
        " payload_sha256, occurred_at, received_at, processed_at, archived_at)"
        " VALUES (%(tenant_id)s, 'msg_old', 'ignored', sha256('x'::bytea), '0001-01-01 00:00+00',"
        " '0001-01-01 00:00+00', '0001-01-01 00:00+00', now())",
        receipt,
    )
    for event_id in ("msg_far", "msg_old"):
        trace = operations.trace_event(conn, shop.tenant_id, event_id)
        assert trace.found
        text = operations.format_trace(trace)
        assert "outcome=ignored" in text
        assert json.loads(json.dumps(trace.__dict__, default=str))["event_id"] == event_id
    far = operations.format_trace(operations.trace_event(conn, shop.tenant_id, "msg_far"))
    assert "processed=infinity" in far
    for argv in ([], ["--json"]):
        status, text = run(settings, "trace", "msg_far", "--tenant", shop.tenant_id, *argv)
        assert status == 0 and "infinity" in text


def test_exceptions_list_shows_open_ones_and_anomalies_list_the_conflicts(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    assert deliver(conn, shop, StandardEvent(merchant_reference="nope", gateway_order_id="pi_x"))
    status, text = run(settings, "exceptions", "list")
    [exception] = lines(text)
    assert status == 0 and exception["kind"] == "unmapped_order"
    assert exception["tenant_id"] == shop.tenant_id

    resolve = ["exceptions", "resolve", str(exception["id"])]
    with pytest.raises(SystemExit):  # the reason is required
        run(settings, *resolve)
    assert run(settings, *resolve, "--note", "paid by bank transfer, order 9")[0] == 0
    assert run(settings, "exceptions", "list")[1] == ""
    [closed] = lines(run(settings, "exceptions", "list", "--all")[1])
    assert closed["resolved_at"] is not None
    assert closed["detail"]["resolution"] == "by_hand"

    factory.order(shop)
    event = StandardEvent()
    assert deliver(conn, shop, event) == "applied"
    tampered = StandardEvent(event_id=event.event_id, amount=1)
    assert deliver(conn, shop, tampered) == "digest_conflict"
    [anomaly] = lines(run(settings, "anomalies", "list", "--kind", "digest_conflict")[1])
    assert anomaly["event_id"] == event.event_id and anomaly["kind"] == "digest_conflict"
    assert anomaly["stored_sha256"] != anomaly["received_sha256"]
    assert run(settings, "anomalies", "list", "--kind", "signature_invalid")[1] == ""


def dead_letter(redis_conn: Redis, queue: Queue, job: Job) -> Job:
    """Run `job` once, with no retries left, in a worker without a database: it fails."""
    job.retries_left = 0
    job.save()
    worker = PayhookWorker(
        [queue.name], connection=redis_conn, serializer=JSONSerializer, job_class=PayhookJob
    )
    worker.work(burst=True, logging_level="ERROR")
    assert job.id in FailedJobRegistry(queue=queue).get_job_ids()
    return job


def test_a_dead_letter_job_requeued_from_the_cli_is_applied_by_a_consumer(
    factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    queue = events_queue(redis_conn, settings)
    envelope = factory.standard_envelope(shop, StandardEvent())
    job = dead_letter(redis_conn, queue, enqueue_event(queue, envelope, settings))

    status, text = run(settings, "dlq", "list")
    [listed] = lines(text)
    assert listed["id"] == job.id and listed["function"] == APPLY_EVENT
    assert "runs only in a payhook consumer" in listed["error"]

    status, text = run(settings, "dlq", "requeue", job.id)
    assert (status, lines(text)) == (0, [{"id": job.id, "requeued": True}])
    assert FailedJobRegistry(queue=queue).get_job_ids() == []
    assert queue.get_job_ids() == [job.id]
    again = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert list(again.args) == [envelope.to_json()]
    assert again.retries_left == len(settings.job_retry_intervals)

    pool = create_pool(settings, "test", size=1)
    pool.open()
    try:
        runtime = Runtime(settings=settings, pool=pool, redis=redis_conn)
        build_worker(settings, runtime).work(burst=True, logging_level="ERROR")
    finally:
        pool.close()
    assert Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer).return_value() == {
        "outcome": "applied",
        "order_id": order_id,
        "retries": 0,
    }
    assert factory.order_state(shop, order_id) == "paid"


@dataclass
class Crash:
    """Where a process dies among the commands it sends Redis: before its
    command number `at` leaves, or (`after`) once it left, before its reply."""

    at: int
    after: bool
    sent: int = 0
    dead: bool = False


def dying_client(url: str, crash: Crash) -> Redis:
    """A client whose process dies where `crash` says: from then on nothing it
    sends reaches Redis and no reply reaches it, whatever redis-py retries."""

    class Dying(Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if not crash.dead and crash.sent == crash.at and not crash.after:
                crash.dead = True
            if crash.dead:
                raise RedisConnectionError("the process died")
            # Unannotated in redis-py; untyped_calls_exclude matches no call through super().
            super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]
            crash.dead = crash.sent == crash.at
            crash.sent += 1

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            if crash.dead:
                raise RedisConnectionError("the process died")
            return super().read_response(*args, **kwargs)

    return Redis(connection_pool=ConnectionPool.from_url(url, connection_class=Dying))


def test_a_requeue_cut_off_anywhere_leaves_the_job_in_exactly_one_place(
    factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """Out of the registry and onto the queue, or neither: a dead-letter job is
    the only copy of an acknowledged event. The requeuing process dies before
    or after each command it sends in turn, until one requeue runs through."""
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    registry = FailedJobRegistry(queue=queue)
    outcomes: set[tuple[bool, bool]] = set()
    for at in range(100):
        for after in (False, True):
            job = dead_letter(
                redis_conn,
                queue,
                enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings),
            )
            crash = Crash(at, after)
            client = dying_client(settings.redis_url, crash)
            try:
                requeue_dead_letter(client, settings, job.id)
            except RedisConnectionError:
                assert crash.dead
            finally:
                client.close()
            queued = queue.get_job_ids().count(job.id)
            failed = registry.get_job_ids().count(job.id)
            assert (queued, failed) in {(1, 0), (0, 1)}, (at, after)
            outcomes.add((crash.dead, queued == 1))
            if not crash.dead:
                break
            # as the operator does, once the dashboard or the command is back
            if failed:
                requeue_dead_letter(redis_conn, settings, job.id)
            else:
                with pytest.raises(NotRequeueable, match="not in the dead-letter queue"):
                    requeue_dead_letter(redis_conn, settings, job.id)
            assert queue.get_job_ids().count(job.id) == 1
            assert job.id not in registry.get_job_ids()
        else:
            continue
        break
    else:
        raise AssertionError("the requeue never ran through")
    # died before the move, died after it, and one that ran through
    assert outcomes == {(True, False), (True, True), (False, True)}


def test_a_move_redis_cannot_finish_leaves_the_job_in_the_dead_letter_queue(
    factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """Redis runs each command of a MULTI/EXEC on its own and rolls none back: a
    requeue whose push onto the queue fails in Redis (here the queue's key holds
    something else) must not have taken the job out of the dead-letter queue."""
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    envelope = factory.standard_envelope(shop, StandardEvent())
    job = dead_letter(redis_conn, queue, enqueue_event(queue, envelope, settings))
    redis_conn.set(queue.key, "not a list")

    with pytest.raises(NotRequeueable, match="not a list"):
        requeue_dead_letter(redis_conn, settings, job.id)
    status, text = run(settings, "dlq", "requeue", "--all")
    assert (status, json.loads(text)) == (1, {"requeued": [], "refused": [job.id]})
    assert FailedJobRegistry(queue=queue).get_job_ids() == [job.id]
    stored = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert stored.get_status() == JobStatus.FAILED

    redis_conn.delete(queue.key)
    requeue_dead_letter(redis_conn, settings, job.id)
    assert queue.get_job_ids() == [job.id]
    assert FailedJobRegistry(queue=queue).get_job_ids() == []


#: Fields of a dead-letter job's hash that RQ's enqueueing reads, and a value
#: each may hold in a damaged or hand-edited hash whose call is still payhook's.
ODD_FIELDS: dict[str, dict[str, str]] = {
    # RQ's enqueue leaves a deferred job off the queue, waiting for its dependencies.
    "deferred": {"status": "deferred"},
    "dependency": {"dependency_ids": json.dumps(["never-ran"])},
    "rate_limited": {"rate_limit_key": "shop", "rate_limit_concurrency": "1"},
    "unreadable_meta": {"meta": "not json"},
}


def test_a_dead_letter_with_odd_fields_is_requeued_and_stops_no_other(
    factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """Whatever else its hash says, a dead-letter event job is put on the queue
    with the status queued, never taken out of the registry and left nowhere."""
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    jobs = {
        name: dead_letter(
            redis_conn,
            queue,
            enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings),
        )
        for name in [*ODD_FIELDS, "plain"]
    }
    for name, fields in ODD_FIELDS.items():
        redis_conn.hset(jobs[name].key, mapping=cast(dict[FieldT, EncodableT], fields))

    status, text = run(settings, "dlq", "requeue", "--all")
    answer = json.loads(text)
    assert status == 0 and answer["refused"] == []
    assert sorted(answer["requeued"]) == sorted(job.id for job in jobs.values())
    assert sorted(queue.get_job_ids()) == sorted(job.id for job in jobs.values())
    assert FailedJobRegistry(queue=queue).get_job_ids() == []
    for name, job in jobs.items():
        again = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
        assert again.get_status() == JobStatus.QUEUED, name
        assert again.retries_left == len(settings.job_retry_intervals), name
        assert again.started_at is None and again.ended_at is None, name
        assert redis_conn.ttl(job.key) == -1, name


@pytest.mark.parametrize(
    ("rewrite", "reason"),
    [
        ("another_call", "not a payhook event job"),
        ("unreadable", "cannot be read"),
    ],
)
def test_a_job_rewritten_while_it_is_requeued_is_checked_again(
    factory: Factory,
    settings: Settings,
    redis_conn: Redis,
    monkeypatch: pytest.MonkeyPatch,
    rewrite: str,
    reason: str,
) -> None:
    """The hash put on the queue is the one checked: a hash rewritten between
    the check and the move (to run another function, or so that RQ cannot read
    it) is read and checked again, and refused, still a dead letter."""
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    job = dead_letter(
        redis_conn,
        queue,
        enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings),
    )
    fields = {
        "another_call": {"data": queue.create_job("os.system", args=("true",)).to_dict()["data"]},
        "unreadable": {"created_at": "not a date"},
    }[rewrite]
    read_job = operations._read_job

    def rewritten_after_read(redis: Redis, job_id: str) -> Any:
        read = read_job(redis, job_id)
        redis_conn.hset(job.key, mapping=cast(dict[FieldT, EncodableT], fields))
        return read

    monkeypatch.setattr(operations, "_read_job", rewritten_after_read)
    with pytest.raises(NotRequeueable, match=reason):
        requeue_dead_letter(redis_conn, settings, job.id)
    assert queue.get_job_ids() == []
    assert FailedJobRegistry(queue=queue).get_job_ids() == [job.id]
    assert redis_conn.hget(job.key, "status") == b"failed"


def test_a_requeued_job_loses_the_dead_letter_expiry(
    factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """A failed job expires with the dead-letter queue's 30 days; requeued, it
    must wait on the queue however long the consumers take, not vanish from
    it when those 30 days run out."""
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    envelope = factory.standard_envelope(shop, StandardEvent())
    job = dead_letter(redis_conn, queue, enqueue_event(queue, envelope, settings))
    assert redis_conn.ttl(job.key) > 0
    redis_conn.expire(job.key, 30)  # as if failed almost 30 days ago

    requeue_dead_letter(redis_conn, settings, job.id)

    assert redis_conn.ttl(job.key) == -1, "the job key must not expire while queued"
    assert queue.get_job_ids() == [job.id]


def test_an_unreadable_job_in_the_dead_letter_queue_stops_nothing(
    factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """A job hash RQ cannot read (forged or damaged) is listed and refused;
    `requeue --all` still requeues every good job beside it."""
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    good = dead_letter(
        redis_conn,
        queue,
        enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings),
    )
    registry = FailedJobRegistry(queue=queue)
    damaged = redis_conn.hgetall(good.key) | {b"created_at": b"not a date"}
    redis_conn.hset("rq:job:bad-date", mapping=cast(dict[FieldT, EncodableT], damaged))
    redis_conn.zadd(registry.key, {"bad-date": time.time() + 86400})

    status, text = run(settings, "dlq", "list")
    listed = {row["id"]: row for row in lines(text)}
    assert status == 0 and set(listed) == {"bad-date", good.id}
    assert listed["bad-date"]["function"] is None
    assert listed["bad-date"]["error"].startswith("unreadable job")

    status, text = run(settings, "dlq", "requeue", "bad-date")
    assert status == 1 and "cannot be read" in lines(text)[0]["reason"]
    status, text = run(settings, "dlq", "requeue", "--all")
    assert (status, json.loads(text)) == (1, {"requeued": [good.id], "refused": ["bad-date"]})
    assert queue.get_job_ids() == [good.id]
    assert registry.get_job_ids() == ["bad-date"]


def test_a_dead_letter_job_whose_data_would_expand_without_bound_is_never_expanded(
    factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """Data compressed a thousandfold is refused as unreadable before RQ
    would inflate it in the command's memory."""
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    bomb = dead_letter(
        redis_conn,
        queue,
        enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings),
    )
    redis_conn.hset(bomb.key, "data", zlib.compress(b"\0" * (data_bound(settings.max_body) + 1)))

    status, text = run(settings, "dlq", "list")
    [row] = lines(text)
    assert status == 0 and row["function"] is None
    assert "data: expands past" in row["error"]
    status, text = run(settings, "dlq", "requeue", bomb.id)
    assert status == 1 and "data: expands past" in lines(text)[0]["reason"]
    assert FailedJobRegistry(queue=queue).get_job_ids() == [bomb.id]


def test_a_dead_letter_job_whose_result_cannot_be_read_hides_no_other(
    factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """RQ decodes a job's stored result when it is read: one damaged or forged
    (here not zlib) is listed as unreadable, and every other job still is."""
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    damaged, good = (
        dead_letter(
            redis_conn,
            queue,
            enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings),
        )
        for _ in range(2)
    )
    redis_conn.xadd(f"rq:results:{damaged.id}", {"type": "2", "exc_string": "bm90IHpsaWI="})

    status, text = run(settings, "dlq", "list")
    listed = {row["id"]: row for row in lines(text)}
    assert status == 0 and set(listed) == {damaged.id, good.id}
    assert listed[damaged.id]["error"] == "unreadable result: zlib.error"
    assert listed[damaged.id]["function"] == APPLY_EVENT
    assert "runs only in a payhook consumer" in listed[good.id]["error"]
    done = run_cli(settings, "dlq", "list")
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert {row["id"] for row in lines(done.stdout)} == {damaged.id, good.id}


def test_two_requeues_of_one_job_at_once_put_it_on_the_queue_once(
    factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    jobs = [
        dead_letter(
            redis_conn,
            queue,
            enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings),
        )
        for _ in range(5)
    ]
    barrier = threading.Barrier(8)

    def requeue(job_id: str) -> bool:
        own = Redis.from_url(settings.redis_url)
        barrier.wait()
        try:
            requeue_dead_letter(own, settings, job_id)
        except NotRequeueable:
            return False
        finally:
            own.close()
        return True

    targets = [jobs[0].id] * 4 + [job.id for job in jobs[1:]]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(requeue, targets))
    assert results[:4].count(True) == 1 and all(results[4:])
    assert sorted(queue.get_job_ids()) == sorted(job.id for job in jobs)
    assert FailedJobRegistry(queue=queue).get_job_ids() == []


def test_only_payhook_event_jobs_of_the_events_queue_are_requeued(
    factory: Factory, settings: Settings, redis_conn: Redis, tmp_path: Path
) -> None:
    queue = events_queue(redis_conn, settings)
    marker = tmp_path / "ran"
    forged = dead_letter(
        redis_conn, queue, queue.enqueue("os.system", f"touch {marker}", retry=None)
    )
    other = Queue("somebody-elses", connection=redis_conn, serializer=JSONSerializer)
    foreign = other.enqueue(APPLY_EVENT, {"v": 1})

    with pytest.raises(NotRequeueable, match="not a payhook event job"):
        requeue_dead_letter(redis_conn, settings, forged.id)
    with pytest.raises(NotRequeueable, match="belongs to queue"):
        requeue_dead_letter(redis_conn, settings, foreign.id)
    status, text = run(settings, "dlq", "requeue", "--all")
    assert (status, json.loads(text)) == (1, {"requeued": [], "refused": [forged.id]})
    assert FailedJobRegistry(queue=queue).get_job_ids() == [forged.id]
    assert queue.get_job_ids() == []
    assert not marker.exists()


def test_a_pickled_job_is_never_unpickled_by_the_cli(
    settings: Settings, redis_conn: Redis, tmp_path: Path
) -> None:
    """Whoever can write to Redis must not run code in an operator's shell."""
    marker = tmp_path / "unpickled"
    queue = events_queue(redis_conn, settings)
    job_id = plant_pickled_job(redis_conn, queue, marker)
    status, text = run(settings, "dlq", "list")
    [listed] = lines(text)
    assert listed["id"] == job_id and listed["function"] is None
    status, text = run(settings, "dlq", "requeue", job_id)
    assert status == 1 and "not a payhook event job" in text
    assert not marker.exists()


class Touch:
    """Unpickling this creates `path`: proof that something unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def plant_pickled_job(redis_conn: Redis, queue: Queue, marker: Path) -> str:
    """A dead-letter job written straight into Redis, its call and meta pickled."""
    job_id = str(uuid.uuid4())
    redis_conn.hset(
        f"rq:job:{job_id}",
        mapping={
            "data": pickle.dumps((APPLY_EVENT, None, (Touch(marker),), {})),
            "meta": pickle.dumps({"x": Touch(marker)}),
            "origin": queue.name,
            "status": "failed",
            "created_at": "2026-01-01T00:00:00.000000Z",
            "description": "planted",
        },
    )
    redis_conn.zadd(FailedJobRegistry(queue=queue).key, {job_id: 4102444800})
    return job_id


def test_bad_input_is_a_clear_error_with_exit_2_never_a_traceback(
    factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed_port = unused.getsockname()[1]
    empty = f"payhook_test_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{empty}"')
    order = ["orders", "add", "--tenant", shop.tenant_id, "--currency", "EUR"]
    cases: list[tuple[list[str], dict[str, str], str]] = [
        (["exceptions", "replay", "1", "--tenant", "bogus"], {}, "--tenant: expected a UUID"),
        (
            ["exceptions", "resolve", "1", "--tenant", "bogus", "--note", "n"],
            {},
            "--tenant: expected a UUID",
        ),
        ([*order, "--merchant-ref", "", "--gateway-order-id", "pi_1", "--amount", "5"], {},
         "--merchant-ref may not be empty"),
        ([*order, "--merchant-ref", "r", "--gateway-order-id", "", "--amount", "5"], {},
         "--gateway-order-id may not be empty"),
        ([*order, "--merchant-ref", "r", "--gateway-order-id", "g", "--amount", "9" * 20], {},
         "--amount must be a positive number"),
        (["dlq", "list"], {"REDIS_URL": f"redis://127.0.0.1:{closed_port}/0"},
         "payhook: error: Redis:"),
        (["uniqueness", "check", "--table", "payhook.x", "--columns", " , ", "--rule", "r"], {},
         "--columns: name at least one column"),
        (["exceptions", "list"], {"DATABASE_URL": f"{PG_SERVER}/{empty}"}, "run `payhook migrate`"),
        ([*order, "--merchant-ref", " ", "--gateway-order-id", "g", "--amount", "5"], {},
         "--merchant-ref may not be empty"),
        ([*order[:-1], "ÉUR", "--merchant-ref", "r", "--gateway-order-id", "g", "--amount", "5"],
         {}, "--currency must be a three-letter code"),
        (["tenants", "add", "acme", "--fulfilment-url", "http://"], {},
         "--fulfilment-url: expected an http:// or https:// URL with a host"),
        (["tenants", "add", "acme", "--fulfilment-url", "http://exa mple.com/x"], {},
         "--fulfilment-url: expected"),
        (["tenants", "add", "acme", "--fulfilment-url", "http://host:port/x"], {},
         "--fulfilment-url: expected"),
        (["tenants", "add", "acme", "--fulfilment-url", f"https://{'a' * 64}.example/x"], {},
         "--fulfilment-url: expected"),
        (["dashboard", "--port", "70000"], {}, "argument --port: expected 1 to 65535"),
        (["dashboard"], {"PAYHOOK_DASHBOARD_PORT": "70001"},
         "PAYHOOK_DASHBOARD_PORT: expected 1 to 65535"),
        (["up", "--port", "70000"], {}, "argument --port: expected 1 to 65535"),
        (["up", "--dashboard-port", "0"], {}, "argument --dashboard-port: expected 1 to 65535"),
        (["endpoints", "add", "--tenant", shop.tenant_id, "--gateway", "stripe", "--secret", " "],
         {}, "--secret: a Stripe signing secret is whsec_"),
        (["endpoints", "add", "--tenant", shop.tenant_id, "--gateway", "stripe", "--secret",
          "whsec_abc"], {}, "--secret: a Stripe signing secret is whsec_"),
        (["send", "--url", "http://[::1", "--secret", "whsec_c2VjcmV0", "--gateway-order-id",
          "g", "--amount", "1", "--currency", "EUR"], {}, "--url:"),
        (["send", "--url", "http://127.0.0.1:9/", "--secret", "whsec_c2VjcmV0", "--event-id",
          "msg_é", "--gateway-order-id", "g", "--amount", "1", "--currency", "EUR"], {},
         "--event-id: printable ASCII only"),
    ]  # fmt: skip
    try:
        for argv, env, message in cases:
            done = run_cli(settings, *argv, **env)
            assert done.returncode == 2, (argv, done.stderr)
            assert message in done.stderr, (argv, done.stderr)
            assert "Traceback" not in done.stderr
    finally:
        with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{empty}" WITH (FORCE)')


def test_an_exception_kind_that_does_not_exist_is_refused_not_an_empty_list(
    settings: Settings,
) -> None:
    result = run_cli(settings, "exceptions", "list", "--kind", "amount_missmatch")
    assert result.returncode == 2 and "invalid choice: 'amount_missmatch'" in result.stderr
    assert run_cli(settings, "exceptions", "list", "--kind", "amount_mismatch").returncode == 0


def test_tenants_add_refuses_a_fulfilment_url_to_an_internal_address(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    """Exit 2 with the reason, as the other admin errors; no tenant is created."""
    insecure = {"PAYHOOK_ALLOW_INSECURE_FULFILMENT": "1"}
    cases: list[tuple[str, dict[str, str], str]] = [
        ("http://169.254.169.254/latest/meta-data/", insecure, "is a link-local address"),
        ("http://127.0.0.1:6379", insecure, "127.0.0.1 is a loopback address"),
        ("http://10.0.0.1/", insecure, "10.0.0.1 is a private address"),
        ("http://[::1]/", insecure, "::1 is a loopback address"),
        ("http://0x7f000001/", insecure, "127.0.0.1 is a loopback address"),
        ("http://2130706433/", insecure, "127.0.0.1 is a loopback address"),
        ("https://[::ffff:127.0.0.1]/", {}, "is an IPv4-mapped address"),
        ("https://224.0.0.1/", {}, "224.0.0.1 is a multicast address"),
        ("https://0.0.0.0/", {}, "0.0.0.0 is an unspecified address"),
        ("https://[fc00::1]/", {}, "fc00::1 is a private address"),
        ("https://[fe80::1]/", {}, "fe80::1 is a link-local address"),
        ("https://localhost/fulfil", {}, "is a loopback address"),
        ("https://user:s3cr3t@shop.example/", {}, "the URL carries credentials"),
        ("http://shop.example/fulfil", {}, "PAYHOOK_ALLOW_INSECURE_FULFILMENT=1"),
        ("https://10.0.0.1/", {"PAYHOOK_FULFILMENT_ALLOW_NETWORKS": "192.168.0.0/16"},
         "10.0.0.1 is a private address"),
    ]  # fmt: skip
    before = Factory(conn).count("tenants")
    for url, env, message in cases:
        done = run_cli(settings, "tenants", "add", "acme", "--fulfilment-url", url, **env)
        assert done.returncode == 2, (url, done.stdout, done.stderr)
        assert "payhook: error: --fulfilment-url: refused: " in done.stderr, (url, done.stderr)
        assert message in done.stderr, (url, done.stderr)
        assert "s3cr3t" not in done.stderr and "Traceback" not in done.stderr
    assert Factory(conn).count("tenants") == before


def test_tenants_add_accepts_a_private_receiver_the_operator_allowed(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    allowed = {"PAYHOOK_FULFILMENT_ALLOW_NETWORKS": "10.0.0.0/8, 127.0.0.0/8"}
    done = run_cli(settings, "tenants", "add", "acme", "--fulfilment-url", "https://10.1.2.3/f",
                   **allowed)  # fmt: skip
    assert done.returncode == 0, done.stderr
    tenant_id = str(uuid.UUID(done.stdout.strip()))
    stored = conn.execute(
        "SELECT fulfilment_url FROM payhook.tenants WHERE id = %s", (tenant_id,)
    ).fetchone()
    assert stored is not None and stored["fulfilment_url"] == "https://10.1.2.3/f"
    # Plain http to it still needs the insecure flag.
    done = run_cli(settings, "tenants", "add", "acme", "--fulfilment-url", "http://10.1.2.3/f",
                   **allowed)  # fmt: skip
    assert done.returncode == 2 and "PAYHOOK_ALLOW_INSECURE_FULFILMENT=1" in done.stderr


def test_a_bad_allowed_network_fails_naming_the_variable(settings: Settings) -> None:
    done = run_cli(
        settings, "tenants", "add", "acme", "--fulfilment-url", "https://10.0.0.1/",
        PAYHOOK_FULFILMENT_ALLOW_NETWORKS="10.0.0.0/40",
    )  # fmt: skip
    assert done.returncode == 2
    assert "payhook: error: PAYHOOK_FULFILMENT_ALLOW_NETWORKS: expected CIDRs" in done.stderr
