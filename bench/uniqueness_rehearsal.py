"""Rehearse adding a unique rule to a live table of 1,000,000 rows.

    python -m bench.uniqueness_rehearsal [--rows 1000000] [--workers 2] [--rate 50]

Real `payhook consumer` processes apply a steady stream of signed events
(one in five an amount mismatch, which writes the table being indexed) while:

1. payhook.payment_exceptions holds --rows rows, a few of them two copies of
   one event, as an operator replay could have recorded them;
2. (baseline) after --warmup seconds of load, nothing else happens for
   --baseline seconds;
3. (check) the pre-check finds and classifies the copies;
4. (resolve) the copies are collapsed into the quarantine;
5. (migrate) a no-transaction migration builds the rule:
   CREATE UNIQUE INDEX CONCURRENTLY, then ADD CONSTRAINT ... USING INDEX;
6. (after) nothing else happens, for --after seconds.

Apply latency is one job's time inside the worker (RQ's started_at to
ended_at): signature verification and the transaction. End to end adds the
time the job waited in the queue. Then the queue is drained and the run
checks that no job failed, no consumer logged an error, every event was
applied exactly once, and the index is valid and backs the constraint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from psycopg import sql
from redis import Redis
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from control import admin
from control.migrations import apply_migrations, list_migrations
from control.unique_rules import UniqueRule
from control.uniqueness import check_rule, resolve_rule
from payhook.db import Row, connect
from payhook.envelope import Envelope
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, TEST_SECRETS_KEY, StandardEvent
from tests.processes import process_env, start, stop, wait_until

PG = os.environ.get("PAYHOOK_BENCH_PG", "postgresql://postgres@127.0.0.1:5432")
REDIS = os.environ.get("PAYHOOK_BENCH_REDIS", "redis://127.0.0.1:6379/13")
DB = "payhook_rehearsal"

RULE = UniqueRule(
    "payment_exceptions_event_kind_key",
    "payhook.payment_exceptions",
    ("tenant_id", "event_id", "kind"),
)
#: The migration under rehearsal: one exception per event and kind.
MIGRATION = """-- payhook: no-transaction
-- One exception per event and kind: a replay must not record the same one twice.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS payment_exceptions_event_kind_key
    ON payhook.payment_exceptions (tenant_id, event_id, kind);
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint WHERE conname = 'payment_exceptions_event_kind_key'
    ) THEN
        ALTER TABLE payhook.payment_exceptions
            ADD CONSTRAINT payment_exceptions_event_kind_key
            UNIQUE USING INDEX payment_exceptions_event_kind_key;
    END IF;
END
$$;
"""
#: Every n-th event is an amount mismatch, which writes an exception row.
MISMATCH_EVERY = 5
PHASES = ("baseline", "check", "resolve", "migrate", "after")


@dataclass(frozen=True)
class Plan:
    rows: int = 1_000_000
    #: Groups of two copies of one event among the rows.
    copies: int = 100
    workers: int = 2
    #: Events enqueued per second.
    rate: float = 50.0
    #: Seconds of load before the baseline starts: connections, caches, JIT of the workers.
    warmup: float = 5.0
    baseline: float = 20.0
    after: float = 10.0


@dataclass
class Figures:
    """What the rehearsal measured and checked."""

    plan: Plan
    #: Seconds each phase took.
    durations: dict[str, float] = field(default_factory=dict)
    #: Per phase: jobs, p50, p99 and max apply latency, p99 end to end (ms).
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    events: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    failed_jobs: int = 0
    consumer_errors: int = 0
    receipts: int = 0
    exceptions_after: int = 0
    quarantined: int = 0
    conflicts_found: dict[str, int] = field(default_factory=dict)
    index_valid: bool = False
    constrained: bool = False

    @property
    def lost(self) -> int:
        """Events enqueued that left no receipt."""
        return self.events - self.receipts

    def problems(self) -> list[str]:
        """Everything that contradicts a correct rehearsal; empty when it went right."""
        found = []
        mismatches = self.outcomes.get("amount_mismatch", 0)
        if self.failed_jobs or self.consumer_errors:
            found.append(f"{self.failed_jobs} failed jobs, {self.consumer_errors} consumer errors")
        if self.lost or sum(self.outcomes.values()) != self.events:
            found.append(f"{self.lost} events without a receipt, outcomes {self.outcomes}")
        if self.outcomes.get("applied", 0) + mismatches != self.events:
            found.append(f"unexpected outcomes {self.outcomes}")
        expected = self.plan.rows + self.plan.copies + mismatches - self.quarantined
        if self.exceptions_after != expected or self.quarantined != self.plan.copies:
            found.append(
                f"{self.exceptions_after} exception rows, expected {expected}; "
                f"{self.quarantined} quarantined of {self.plan.copies} copies"
            )
        if not (self.index_valid and self.constrained):
            found.append("the unique index is not valid or backs no constraint")
        return found


def rehearse(settings: Settings, redis: Redis, workdir: Path, plan: Plan) -> Figures:
    """Run the rehearsal against a migrated database; see the module docstring."""
    figures = Figures(plan)
    with connect(settings, "rehearsal", owner=True) as conn:
        tenant, endpoint = _shop(conn)
        _orders(conn, tenant.tenant_id, plan)
        _history(conn, tenant.tenant_id, plan)
    folder = _migrations_with_rule(workdir)
    queue = events_queue(redis, settings)
    consumers = [
        start(["consumer"], process_env(settings), workdir / f"consumer-{i}.log")
        for i in range(plan.workers)
    ]
    feeder = _Feeder(settings, redis, endpoint, plan.rate)
    windows: dict[str, tuple[datetime, datetime]] = {}
    try:
        wait_until(lambda: len(_worker_names(redis, settings)) >= plan.workers, 60, "consumers")
        feeder.start()
        time.sleep(plan.warmup)
        for phase in PHASES:
            started, clock = datetime.now(UTC), time.perf_counter()
            if phase in ("baseline", "after"):
                time.sleep(plan.baseline if phase == "baseline" else plan.after)
            elif phase == "check":
                with connect(settings, "rehearsal", owner=True) as conn:
                    figures.conflicts_found = dict(
                        Counter(g.classification for g in check_rule(conn, RULE).groups)
                    )
            elif phase == "resolve":
                with connect(settings, "rehearsal", owner=True) as conn:
                    figures.quarantined = resolve_rule(conn, RULE).quarantined
            else:
                apply_migrations(settings, folder)
            windows[phase] = (started, datetime.now(UTC))
            figures.durations[phase] = time.perf_counter() - clock
        feeder.stop()
        wait_until(lambda: _drained(redis, feeder.job_ids), 120, "the queue to drain")
    finally:
        feeder.stop()
        for proc in consumers:
            stop(proc, timeout=20)
    _measure(figures, redis, feeder.job_ids, windows)
    figures.failed_jobs = len(FailedJobRegistry(queue=queue))
    figures.consumer_errors = sum(_errors(p.read_text()) for p in workdir.glob("consumer-*.log"))
    with connect(settings, "rehearsal", owner=True) as conn:
        figures.receipts = _count(conn, "payment_event_receipts")
        figures.exceptions_after = _count(conn, "payment_exceptions")
        state = conn.execute(
            "SELECT x.indisvalid AS valid, EXISTS (SELECT 1 FROM pg_constraint k"
            " WHERE k.conindid = x.indexrelid AND k.contype = 'u') AS constrained"
            " FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid WHERE c.relname = %s",
            (RULE.name,),
        ).fetchone()
        figures.index_valid = bool(state and state["valid"])
        figures.constrained = bool(state and state["constrained"])
    return figures


# Setup


@dataclass(frozen=True)
class _Tenant:
    tenant_id: str


@dataclass(frozen=True)
class _Endpoint:
    endpoint_id: str
    secret: str


def _shop(conn: psycopg.Connection[Row]) -> tuple[_Tenant, _Endpoint]:
    tenant = admin.add_tenant(conn, "rehearsal", keyring=TEST_KEYRING)
    endpoint = admin.add_endpoint(conn, tenant, "standard", keyring=TEST_KEYRING)
    return _Tenant(tenant), _Endpoint(endpoint.endpoint_id, endpoint.secret)


def _orders(conn: psycopg.Connection[Row], tenant_id: str, plan: Plan) -> None:
    """One order per event the feeder can send in the longest plausible run."""
    count = int(plan.rate * (plan.warmup + plan.baseline + plan.after + 600))
    conn.execute(
        "INSERT INTO payhook.payment_orders"
        " (tenant_id, id, merchant_reference, gateway_order_id, amount_minor, currency)"
        " SELECT %s, gen_random_uuid(), 'r-' || i, 'pi_' || i, 1500, 'EUR'"
        " FROM generate_series(0, %s) AS i",
        (tenant_id, count),
    )


def _history(conn: psycopg.Connection[Row], tenant_id: str, plan: Plan) -> None:
    """`rows` exceptions of ten tenants, and `copies` of them recorded a second time."""
    conn.execute(
        "INSERT INTO payhook.payment_exceptions"
        " (tenant_id, event_id, kind, detail, event, created_at)"
        " SELECT CASE WHEN i %% 10 = 0 THEN %(tenant)s::uuid"
        "             ELSE md5('tenant' || i %% 10)::uuid END,"
        "        'hist_' || i,"
        "        (ARRAY['amount_mismatch', 'unmapped_order', 'identity_mismatch'])[1 + i %% 3],"
        "        jsonb_build_object('expected', 1500, 'received', i %% 1000),"
        "        jsonb_build_object('event_id', 'hist_' || i, 'amount_minor', i %% 1000),"
        "        now() - make_interval(secs => i)"
        " FROM generate_series(1, %(rows)s) AS i",
        {"tenant": tenant_id, "rows": plan.rows},
    )
    conn.execute(
        "INSERT INTO payhook.payment_exceptions"
        " (tenant_id, event_id, kind, detail, event, created_at)"
        " SELECT tenant_id, event_id, kind, detail, event, now()"
        " FROM payhook.payment_exceptions WHERE event_id = ANY(%s)",
        (
            [f"hist_{i}" for i in range(1, plan.rows + 1, max(1, plan.rows // plan.copies))][
                : plan.copies
            ],
        ),
    )
    conn.execute("VACUUM ANALYZE payhook.payment_exceptions")


def _migrations_with_rule(workdir: Path) -> Path:
    folder = workdir / "migrations"
    folder.mkdir(exist_ok=True)
    existing = list_migrations()
    for migration in existing:
        shutil.copy(migration.path, folder / migration.path.name)
    (folder / f"{len(existing) + 1:04d}_payment_exceptions_event_kind_key.sql").write_text(
        MIGRATION
    )
    return folder


# Load


class _Feeder:
    """Enqueues one signed event every 1/rate seconds on its own thread."""

    def __init__(self, settings: Settings, redis: Redis, endpoint: _Endpoint, rate: float):
        self.settings = settings
        self.queue = events_queue(redis, settings)
        self.endpoint = endpoint
        self.rate = rate
        self.job_ids: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        started = time.perf_counter()
        i = 0
        while not self._stop.is_set():
            delay = started + i / self.rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            job = enqueue_event(self.queue, self._envelope(i), self.settings)
            self.job_ids.append(job.id)
            i += 1

    def _envelope(self, i: int) -> Envelope:
        amount = 1 if i % MISMATCH_EVERY == MISMATCH_EVERY - 1 else 1500
        event = StandardEvent(
            gateway_order_id=f"pi_{i}", merchant_reference=f"r-{i}", amount=amount
        )
        body = event.body()
        headers = event.headers(self.endpoint.secret, body)
        return Envelope(
            self.endpoint.endpoint_id, body, headers, datetime.now(UTC), str(uuid.uuid4())
        )


def _worker_names(redis: Redis, settings: Settings) -> list[str]:
    from rq import Worker

    return [w.name for w in Worker.all(queue=events_queue(redis, settings))]


def _drained(redis: Redis, job_ids: list[str]) -> bool:
    jobs = Job.fetch_many(job_ids, connection=redis, serializer=JSONSerializer)
    return all(j is not None and j.ended_at is not None for j in jobs)


# Figures


def _measure(
    figures: Figures,
    redis: Redis,
    job_ids: list[str],
    windows: dict[str, tuple[datetime, datetime]],
) -> None:
    figures.events = len(job_ids)
    samples: dict[str, list[tuple[float, float]]] = {phase: [] for phase in PHASES}
    outcomes: Counter[str] = Counter()
    for job in Job.fetch_many(job_ids, connection=redis, serializer=JSONSerializer):
        if job is None or job.started_at is None or job.ended_at is None:
            continue
        result = job.return_value()
        outcomes[result["outcome"] if isinstance(result, dict) else "failed"] += 1
        started, ended = _aware(job.started_at), _aware(job.ended_at)
        enqueued = _aware(job.enqueued_at) if job.enqueued_at else started
        apply = (ended - started).total_seconds() * 1000
        total = (ended - enqueued).total_seconds() * 1000
        for phase, (begin, end) in windows.items():
            if begin <= started < end:
                samples[phase].append((apply, total))
    figures.outcomes = dict(outcomes)
    for phase, values in samples.items():
        applies = sorted(v[0] for v in values)
        totals = sorted(v[1] for v in values)
        figures.latency[phase] = {
            "jobs": len(values),
            "p50": _percentile(applies, 50),
            "p99": _percentile(applies, 99),
            "max": applies[-1] if applies else 0.0,
            "p99_end_to_end": _percentile(totals, 99),
        }


def _errors(log: str) -> int:
    """Error lines of a consumer log: structlog's JSON errors and any traceback."""
    return sum(_level(line) == "error" or "Traceback" in line for line in log.splitlines())


def _level(line: str) -> object:
    try:
        data = json.loads(line)
    except ValueError:
        return None
    return data.get("level") if isinstance(data, dict) else None


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _percentile(values: list[float], pct: float) -> float:
    if not values:
        return 0.0
    rank = max(0, min(len(values) - 1, round(pct / 100 * len(values) + 0.5) - 1))
    return values[rank]


def _count(conn: psycopg.Connection[Row], table: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) AS n FROM payhook.{}").format(sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return int(row["n"])


def report(figures: Figures) -> str:
    """The figures as the docs show them."""
    plan = figures.plan
    lines = [
        f"unique rule on payhook.payment_exceptions: {plan.rows:,} rows "
        f"(+{plan.copies} copies), {plan.workers} consumer processes, "
        f"{plan.rate:g} events/s, {os.cpu_count()} cores",
        f"  pre-check found {figures.conflicts_found}; {figures.quarantined} copies quarantined",
        "",
        "  phase      seconds   jobs   apply p50   apply p99   apply max   end-to-end p99",
    ]
    for phase in PHASES:
        lat = figures.latency.get(phase, {})
        lines.append(
            f"  {phase:<9} {figures.durations.get(phase, 0):8.1f} {int(lat.get('jobs', 0)):6d}"
            f" {lat.get('p50', 0):9.1f}ms {lat.get('p99', 0):9.1f}ms {lat.get('max', 0):9.1f}ms"
            f" {lat.get('p99_end_to_end', 0):14.1f}ms"
        )
    during = [figures.latency[p] for p in ("check", "resolve", "migrate") if p in figures.latency]
    worst = max((lat["p99"] for lat in during if lat["jobs"]), default=0.0)
    base = figures.latency.get("baseline", {}).get("p99", 0.0)
    lines += [
        "",
        f"  p99 apply latency: {base:.1f} ms before, {worst:.1f} ms at worst during the change"
        + (f" ({worst / base:.1f}x)" if base else ""),
        f"  events {figures.events}, receipts {figures.receipts}, lost {figures.lost}, "
        f"failed jobs {figures.failed_jobs}, consumer errors {figures.consumer_errors}, "
        f"outcomes {figures.outcomes}",
        f"  index valid {figures.index_valid}, backs the constraint {figures.constrained}",
    ]
    problems = figures.problems()
    lines.append("  PROBLEMS: " + "; ".join(problems) if problems else "  no problem found")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=Plan.rows)
    parser.add_argument("--copies", type=int, default=Plan.copies)
    parser.add_argument("--workers", type=int, default=Plan.workers)
    parser.add_argument("--rate", type=float, default=Plan.rate)
    parser.add_argument("--warmup", type=float, default=Plan.warmup)
    parser.add_argument("--baseline", type=float, default=Plan.baseline)
    parser.add_argument("--after", type=float, default=Plan.after)
    args = parser.parse_args()
    plan = Plan(
        args.rows, args.copies, args.workers, args.rate, args.warmup, args.baseline, args.after
    )
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB)))
    settings = Settings.from_env(
        {
            "DATABASE_URL": f"{PG}/{DB}",
            "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
            "REDIS_URL": REDIS,
            "PAYHOOK_QUEUE": "payhook-rehearsal",
            # The figures are read from the finished jobs once the run is over.
            "PAYHOOK_RESULT_TTL": "2h",
        }
    )
    apply_migrations(settings)
    redis = Redis.from_url(REDIS)
    redis.flushdb()
    with tempfile.TemporaryDirectory(prefix="payhook-rehearsal-") as workdir:
        figures = rehearse(settings, redis, Path(workdir), plan)
    print(report(figures))
    if figures.problems():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
