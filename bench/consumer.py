"""Consumer throughput, beside two ceilings measured in the same run.

    python -m bench.consumer [--events N] [--workers W] [--rounds R]
                             [--fsync always|everysec|no]

1. RQ no-op jobs (same envelopes, same worker class and count): the queue's
   own ceiling; also with RQ's stock `SimpleWorker` and its forking worker,
   to show what payhook's worker takes away.
2. The same verification and SQL transaction, one event at a time, driven
   directly by W processes: the database's ceiling.
3. payhook consumers applying first deliveries, taking `--batch` jobs at a
   time, then the same events again (every job a duplicate); and first
   deliveries taking one job at a time, and taking a batch but committing
   each event alone: what each step of batching brings.
4. First deliveries again, by consumers working as the owner, whom
   row-level security does not restrict (PAYHOOK_DATABASE_ROLE empty), and
   the same transaction driven directly as the owner: what the policies
   cost, as ratios in the same round (the direct one, bound by PostgreSQL
   and not by the queue, shows it best).

Redis is a private redis-server started here with the persistence of
compose.yaml (`appendfsync always`: RQ's writes are durable, as payhook's
commits are) unless --fsync says otherwise; PAYHOOK_BENCH_REDIS names a
server to use instead. Workers log as in production (JSON lines, INFO).

Rates come from RQ's own job timestamps (first start to last end), so worker
start-up is not counted. Figures are printed as ratios to the ceilings:
these machines are noisy, absolute numbers are not comparable across runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from bench.services import (
    FSYNC_CHOICES,
    cpu_seconds,
    parent_pid,
    private_redis,
    server_cpu_seconds,
)
from consumer.transaction import apply_event
from control import admin
from control.migrations import apply_migrations
from payhook.db import connect
from payhook.endpoints import Endpoint
from payhook.envelope import Envelope
from payhook.gateways import get_gateway
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, TEST_SECRETS_KEY, StandardEvent
from tests.processes import process_env

PG = os.environ.get("PAYHOOK_BENCH_PG", "postgresql://postgres@127.0.0.1:5432")
#: A Redis server to use instead of starting one (its database is flushed).
REDIS = os.environ.get("PAYHOOK_BENCH_REDIS")
DB = "payhook_bench"


def fresh_settings(redis_url: str) -> Settings:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB)))
    settings = Settings.from_env(
        {
            "DATABASE_URL": f"{PG}/{DB}",
            "REDIS_URL": redis_url,
            "PAYHOOK_QUEUE": "payhook-bench",
            "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
        }
    )
    apply_migrations(settings)
    return settings


def make_events(settings: Settings, count: int) -> tuple[Endpoint, list[Envelope]]:
    """`count` orders and one signed payment event for each."""
    with connect(settings) as conn:
        tenant = admin.add_tenant(conn, "bench", keyring=TEST_KEYRING)
        endpoint = admin.add_endpoint(conn, tenant, "standard", keyring=TEST_KEYRING)
        envelopes = []
        for i in range(count):
            admin.add_order(conn, tenant, f"ref-{i}", f"pi_{i}", 1500, "EUR")
            event = StandardEvent(
                gateway_order_id=f"pi_{i}", merchant_reference=f"ref-{i}", amount=1500
            )
            body = event.body()
            headers = event.headers(endpoint.secret, body)
            envelopes.append(
                Envelope(endpoint.endpoint_id, body, headers, datetime.now(UTC), str(uuid.uuid4()))
            )
    return Endpoint(endpoint.endpoint_id, tenant, "standard", (endpoint.secret,)), envelopes


@dataclass(frozen=True)
class Meters:
    """Local processes whose CPU a phase is charged with; None where unknown."""

    redis: int | None
    postmaster: int | None


@dataclass(frozen=True)
class Phase:
    """One drain of the queue by the workers."""

    rate: float
    #: CPU µs per job: "workers", "redis", "postgres" (None where not measured).
    cpu_us: dict[str, float | None]


def run_workers(
    settings: Settings,
    redis: Redis,
    envelopes: list[Envelope],
    mode: str,
    kind: str,
    workers: int,
    meters: Meters,
    batch: int = 1,
) -> Phase:
    """Enqueue one job per envelope, drain with `workers` processes: jobs per
    second, and the CPU each kind of process spent per job while they worked."""
    redis.flushdb()
    queue = events_queue(redis, settings)
    ids = []
    for envelope in envelopes:
        fresh = Envelope(
            envelope.endpoint_id,
            envelope.body,
            envelope.headers,
            envelope.received_at,
            str(uuid.uuid4()),
        )
        job = enqueue_event(queue, fresh, settings)
        if mode == "noop":
            job.func_name = "bench.consumer_worker.noop"
            job.save()
        ids.append(job.id)
    env = process_env(settings, PAYHOOK_CONSUMER_BATCH=str(batch))
    with tempfile.TemporaryDirectory(prefix="payhook-bench-cpu-") as folder:
        cpu_files = [Path(folder) / str(i) for i in range(workers)]
        servers_before = _servers_cpu(meters)
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.consumer_worker", mode, kind, str(cpu_file)],
                env=env,
                stdout=subprocess.DEVNULL,
            )
            for cpu_file in cpu_files
        ]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise SystemExit(f"a {mode}/{kind} worker failed")
        _wait_for_backends_to_exit(settings)
        servers_after = _servers_cpu(meters)
        worker_cpu = sum(float(path.read_text()) for path in cpu_files)
    jobs = Job.fetch_many(ids, connection=redis, serializer=JSONSerializer)
    unfinished = [j for j in jobs if j is None or j.ended_at is None]
    if unfinished:
        raise SystemExit(f"{len(unfinished)} jobs did not finish")
    start = min(j.started_at for j in jobs if j and j.started_at)
    end = max(j.ended_at for j in jobs if j and j.ended_at)
    per_job = 1e6 / len(ids)
    cpu: dict[str, float | None] = {"workers": worker_cpu * per_job}
    for name, before in servers_before.items():
        after = servers_after[name]
        cpu[name] = None if before is None or after is None else (after - before) * per_job
    return Phase(len(ids) / (end - start).total_seconds(), cpu)


def _servers_cpu(meters: Meters) -> dict[str, float | None]:
    return {
        "redis": None if meters.redis is None else cpu_seconds(meters.redis),
        "postgres": None if meters.postmaster is None else server_cpu_seconds(meters.postmaster),
    }


def _wait_for_backends_to_exit(settings: Settings, timeout: float = 10.0) -> None:
    """The workers' PostgreSQL backends end after them; their CPU counts once they have."""
    deadline = time.monotonic() + timeout
    with connect(settings) as conn:
        while time.monotonic() < deadline:
            row: Any = conn.execute(
                "SELECT count(*) AS n FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
            if row["n"] == 0:
                return
            time.sleep(0.02)


def find_meters(settings: Settings, redis_pid: int | None) -> Meters:
    """The postmaster of the benchmark's database, when it runs on this machine."""
    with connect(settings) as conn:
        row: Any = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()
        # Asked while the backend is alive: once it has exited it has no parent.
        return Meters(redis=redis_pid, postmaster=parent_pid(row["pid"]))


def _direct(
    args: tuple[Settings, Endpoint, list[Envelope]],
    spans: multiprocessing.SimpleQueue[tuple[float, float]],
) -> None:
    settings, endpoint, envelopes = args
    gateway = get_gateway("standard")
    with connect(settings, "bench") as conn:
        started = time.time()
        for envelope in envelopes:
            gateway.verify(
                envelope.headers, envelope.body, endpoint.secrets, now=None, tolerance=None
            )
            event = gateway.parse(envelope.headers, envelope.body)
            apply_event(conn, endpoint, event, envelope.delivery_id)
        spans.put((started, time.time()))


def run_direct(
    settings: Settings, endpoint: Endpoint, envelopes: list[Envelope], workers: int
) -> float:
    """The same verification and transaction, no queue, one process per worker.

    Timed as the workers are, from the first event started to the last one
    finished, so start-up (imports, connecting) is not counted.
    """
    context = multiprocessing.get_context("spawn")
    spans: multiprocessing.SimpleQueue[tuple[float, float]] = context.SimpleQueue()
    procs = [
        context.Process(target=_direct, args=((settings, endpoint, envelopes[i::workers]), spans))
        for i in range(workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=600)
        if proc.exitcode != 0:
            raise SystemExit("a direct transaction process failed")
    times = [spans.get() for _ in procs]
    elapsed = max(end for _, end in times) - min(start for start, _ in times)
    return len(envelopes) / elapsed


def count(settings: Settings, table: str) -> int:
    """Rows of `table`, every tenant's: as the owner."""
    with connect(settings, owner=True) as conn:
        row: Any = conn.execute(
            sql.SQL("SELECT count(*) AS n FROM payhook.{}").format(sql.Identifier(table))
        ).fetchone()
        return int(row["n"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fsync", choices=FSYNC_CHOICES, default="always")
    parser.add_argument(
        "--batch", type=int, default=Settings.consumer_batch, help="PAYHOOK_CONSUMER_BATCH"
    )
    args = parser.parse_args()
    if REDIS:
        run(args, REDIS, None, "PAYHOOK_BENCH_REDIS")
    else:
        with private_redis(args.fsync) as (redis_url, redis_pid):
            run(args, redis_url, redis_pid, f"private, appendfsync={args.fsync}")


def run(args: argparse.Namespace, redis_url: str, redis_pid: int | None, redis_label: str) -> None:
    n, w = args.events, args.workers
    redis = Redis.from_url(redis_url)
    phases: dict[str, list[Phase]] = {
        name: [] for name in ("stock", "noop", "applied", "duplicates", "owner", "one_job", "alone")
    }
    direct_rates: list[float] = []
    owner_direct_rates: list[float] = []
    fork = 0.0
    # Rounds interleave the phases, so a burst of load elsewhere on the
    # machine hits ceilings and payhook alike; the medians are reported.
    for round_ in range(args.rounds):
        settings = fresh_settings(redis_url)
        meters = find_meters(settings, redis_pid)
        endpoint, envelopes = make_events(settings, 6 * n)
        direct_set, queued_set, owner_set, owner_direct_set, one_job_set, alone_set = (
            envelopes[i * n : (i + 1) * n] for i in range(6)
        )
        # The ceilings and first deliveries (under row-level security or as
        # the owner, one job at a time, without group commit) take turns
        # going first, so none always runs on the fresher Redis and PostgreSQL.
        order = [
            ("stock", "noop", "stock", queued_set, 1),
            ("noop", "noop", "simple", queued_set, 1),
            ("applied", "apply", "simple", queued_set, args.batch),
            ("owner", "apply", "simple", owner_set, args.batch),
            ("one_job", "apply", "simple", one_job_set, 1),
            ("alone", "apply", "alone", alone_set, args.batch),
        ]
        turn = round_ % len(order)
        again = ("duplicates", "apply", "simple", queued_set, args.batch)
        for name, mode, kind, events, batch in [*order[turn:], *order[:turn], again]:
            as_role = replace(settings, database_role="") if name == "owner" else settings
            phases[name].append(
                run_workers(as_role, redis, events, mode, kind, w, meters, batch=batch)
            )
        as_owner = replace(settings, database_role="")
        directs = [
            (direct_rates, settings, direct_set),
            (owner_direct_rates, as_owner, owner_direct_set),
        ]
        for rates, as_role, events in directs[:: 1 if round_ % 2 == 0 else -1]:
            rates.append(run_direct(as_role, endpoint, events, w))
        applied_once = count(settings, "payment_outbox")
        assert applied_once == 6 * n, f"{applied_once} outbox rows for {6 * n} events"
        if round_ == 0:
            fork = run_workers(settings, redis, queued_set, "noop", "fork", w, meters).rate
    redis.flushdb()
    stock, noop, applied, duplicates, owner, one_job, alone = (
        statistics.median(p.rate for p in phases[k])
        for k in ("stock", "noop", "applied", "duplicates", "owner", "one_job", "alone")
    )
    direct = statistics.median(direct_rates)
    owner_direct = statistics.median(owner_direct_rates)
    print(
        f"consumer benchmark: {n} events x {args.rounds} rounds, {w} worker processes, "
        f"{os.cpu_count()} cores (medians); Redis {redis_label}"
    )
    print(f"  RQ no-op jobs, stock SimpleWorker  {stock:8.0f} jobs/s    (ceiling 0)")
    print(
        f"  RQ no-op jobs, PayhookWorker       {noop:8.0f} jobs/s    "
        f"(ceiling 1, {noop / stock:.2f}x ceiling 0)"
    )
    print(
        f"  RQ no-op jobs, forking rq.Worker   {fork:8.0f} jobs/s    "
        f"({fork / noop:.2f}x PayhookWorker)"
    )
    print(f"  same transaction, no queue         {direct:8.0f} events/s  (ceiling 2)")
    print(
        f"  payhook consumers, first delivery  {applied:8.0f} events/s  "
        f"({applied / stock:.2f}x ceiling 0, {applied / direct:.0%} of ceiling 2; "
        f"batches of {args.batch})"
    )
    print(
        f"    one job at a time                {one_job:8.0f} events/s  "
        f"({one_job / direct:.0%} of ceiling 2)"
    )
    print(
        f"    batches, each event committed alone {alone:5.0f} events/s  "
        f"({alone / direct:.0%} of ceiling 2)"
    )
    print(
        f"  payhook consumers, duplicates      {duplicates:8.0f} events/s  "
        f"(one duplicate costs {applied / duplicates:.2f}x a first delivery)"
    )
    print(
        f"  first delivery as the owner        {owner:8.0f} events/s  "
        f"(row-level security costs {1 - applied / owner:.1%})"
    )
    print(
        f"  same transaction as the owner      {owner_direct:8.0f} events/s  "
        f"(row-level security costs {1 - direct / owner_direct:.1%})"
    )
    # Each round measures its no-op ceiling and first deliveries back to back.
    pairs = zip(phases["applied"], phases["stock"], strict=True)
    per_round = ", ".join(f"{first.rate / ceiling.rate:.2f}x" for first, ceiling in pairs)
    print(f"  first delivery / stock no-op, per round [{per_round}]")
    to_direct = zip(phases["applied"], direct_rates, strict=True)
    per_round = ", ".join(f"{first.rate / ceiling:.0%}" for first, ceiling in to_direct)
    print(f"  first delivery / no queue, per round    [{per_round}]")
    pairs = zip(phases["applied"], phases["owner"], strict=True)
    per_round = ", ".join(f"{rls.rate / bypass.rate:.0%}" for rls, bypass in pairs)
    print(f"  under RLS / as the owner, per round [{per_round}]")
    direct_pairs = zip(direct_rates, owner_direct_rates, strict=True)
    per_round = ", ".join(f"{rls / bypass:.0%}" for rls, bypass in direct_pairs)
    print(f"  same, no queue, per round          [{per_round}]")
    print_cpu(phases)


def print_cpu(phases: dict[str, list[Phase]]) -> None:
    """CPU per job by kind of process (medians), and the rate it alone would allow."""
    kinds = ("workers", "redis", "postgres")
    print("CPU per job, µs (medians)        workers    Redis  PostgreSQL     all")
    totals = {}
    for name, label in (
        ("stock", "RQ no-op, stock SimpleWorker"),
        ("noop", "RQ no-op jobs"),
        ("applied", "payhook, first delivery"),
        ("one_job", "  one job at a time"),
        ("alone", "  each committed alone"),
        ("duplicates", "payhook, duplicates"),
    ):
        medians = {}
        for kind in kinds:
            values = [v for p in phases[name] if (v := p.cpu_us[kind]) is not None]
            medians[kind] = statistics.median(values) if values else None
        totals[name] = sum(v for v in medians.values() if v is not None)
        cells = "".join(f"{'-' if medians[k] is None else f'{medians[k]:,.0f}':>10}" for k in kinds)
        print(f"  {label:28s}{cells}{totals[name]:>10,.0f}")
    print(
        "  were the machine's CPU the only limit, first deliveries would run at "
        f"{totals['stock'] / totals['applied']:.2f}x the stock no-op rate"
    )


if __name__ == "__main__":
    main()
