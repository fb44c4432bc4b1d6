"""Outbox delivery: throughput with W workers and idle commit-to-delivery latency.

    python -m bench.outbox [--rows N] [--workers W] [--samples S]

Against one local receiver process (`tests.receiver`, which appends a JSON line
per request), in the same run:

1. Baseline: the receiver's raw rate, from a plain httpx loop with as many
   threads as the workers have deliveries in flight, and one thread's round
   trip. No database, no signing: the ceiling for what follows.
2. Throughput: W `payhook outbox-worker` processes, idle and listening; N rows
   committed in one transaction; rate = N / (last `delivered_at` - commit).
3. Latency when idle: one row committed at a time, with pauses so the workers
   are asleep; latency = the receiver's arrival time - the moment the commit
   returned. What polling alone would give is half the poll interval on average.

Machines here are shared and noisy: compare the figures with the baseline of
the same run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, LiteralString

import httpx
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from control import admin
from control.migrations import apply_migrations
from outbox_worker.config import DEFAULT_BATCH, DEFAULT_CONCURRENCY, DEFAULT_POLL
from payhook.db import Row, connect, execute
from payhook.settings import Settings
from tests.factories import LOCAL_RECEIVER_SETTINGS, LOCAL_RECEIVERS, TEST_KEYRING, TEST_SECRETS_KEY
from tests.receiver import Receiver

PG = os.environ.get("PAYHOOK_BENCH_PG", "postgresql://postgres@127.0.0.1:5432")
DB = "payhook_bench_outbox"


def fresh_settings() -> Settings:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB)))
    settings = Settings.from_env(
        {"DATABASE_URL": f"{PG}/{DB}", "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY}
    )
    apply_migrations(settings)
    return settings


def drop_database() -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def baseline(receiver: Receiver, requests: int, threads: int) -> tuple[float, float]:
    """Requests per second with `threads` threads, and one thread's median round trip (ms)."""
    body = b'{"action":"fulfil_order","bench":true}'
    with httpx.Client(limits=httpx.Limits(max_connections=threads)) as client:
        for _ in range(50):  # warm up connections
            client.post(receiver.url, content=body)
        began = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: client.post(receiver.url, content=body), range(requests)))
        rate = requests / (time.perf_counter() - began)
        trips = []
        for _ in range(200):
            t = time.perf_counter()
            client.post(receiver.url, content=body)
            trips.append((time.perf_counter() - t) * 1000)
    return rate, statistics.median(trips)


class Rows:
    """Outbox rows for one tenant and one order, as the consumer would write them."""

    def __init__(self, conn: psycopg.Connection[Row], url: str) -> None:
        self.conn = conn
        self.tenant = admin.add_tenant(
            conn, "bench", url, keyring=TEST_KEYRING, destinations=LOCAL_RECEIVERS
        )
        self.order = admin.add_order(conn, self.tenant, "ref-1", "pi_1", 1500, "EUR")

    def insert(self, count: int) -> list[str]:
        """Insert `count` rows in one transaction; their idempotency keys."""
        keys = []
        with self.conn.transaction():
            for _ in range(count):
                event_id = f"msg_{uuid.uuid4().hex}"
                execute(
                    self.conn,
                    "insert_outbox",
                    {
                        "id": uuid.uuid4(),
                        "tenant_id": self.tenant,
                        "order_id": self.order,
                        "event_id": event_id,
                        "action": "fulfil_order",
                        "payload": Jsonb({"merchant_reference": "ref-1", "bench": True}),
                    },
                )
                keys.append(f"{self.tenant}:{event_id}:fulfil_order")
        return keys


class Tail:
    """New lines of the receiver's record, read incrementally (cheap to poll)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("r", encoding="utf-8")
        self.file.seek(0, os.SEEK_END)
        self.partial = ""

    def next_request(self) -> dict[str, Any] | None:
        self.partial += self.file.readline()
        if not self.partial.endswith("\n"):
            return None
        line, self.partial = self.partial, ""
        result: dict[str, Any] = json.loads(line)
        return result

    def wait_next(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (request := self.next_request()) is None:
            if time.monotonic() > deadline:
                raise SystemExit("bench: no delivery arrived")
            time.sleep(0.002)
        return request


def start_workers(settings: Settings, count: int, logdir: Path) -> list[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYHOOK_")}
    env |= {
        "DATABASE_URL": str(settings.database_url),
        "PAYHOOK_LOG_LEVEL": "INFO",
        "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
    }
    env |= LOCAL_RECEIVER_SETTINGS
    script = Path(sys.executable).with_name("payhook")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "control.cli"]
    procs = []
    for n in range(count):
        with (logdir / f"worker-{n}.log").open("ab") as out:
            procs.append(
                subprocess.Popen([*command, "outbox-worker"], env=env, stdout=out, stderr=out)
            )
    return procs


def wait_for(check: Any, timeout: float = 300.0) -> None:
    """Poll `check` gently: the figures come from timestamps, not from this loop."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit("bench: timed out")
        time.sleep(0.05)


def scalar(conn: psycopg.Connection[Row], text: LiteralString) -> Any:
    row = conn.execute(text).fetchone()
    assert row is not None
    return next(iter(row.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    threads = args.workers * DEFAULT_CONCURRENCY

    settings = fresh_settings()
    keep = os.environ.get("PAYHOOK_BENCH_KEEP")  # a folder to keep the worker logs in
    with tempfile.TemporaryDirectory() as tmp_dir, Receiver(Path(tmp_dir) / "receiver") as receiver:
        tmp = keep or tmp_dir
        raw_rate, raw_trip = baseline(receiver, args.rows, threads)
        load = os.getloadavg()[0]
        print(f"machine: {os.cpu_count()} CPUs, load {load:.1f}; receiver: tests.receiver")
        print(f"baseline  plain httpx, {threads} threads:  {raw_rate:8.0f} requests/s")
        print(f"baseline  plain httpx, 1 thread round trip: {raw_trip:6.2f} ms (median)")

        procs = start_workers(settings, args.workers, Path(tmp))
        with connect(settings, "bench", owner=True) as conn:
            wait_for(
                lambda: (
                    scalar(
                        conn,
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND application_name = 'payhook-outbox-listen' AND query ILIKE 'LISTEN%'",
                    )
                    == args.workers
                )
            )
            rows = Rows(conn, receiver.url)

            # Throughput: everything due at once.
            rows.insert(args.rows)
            committed = scalar(conn, "SELECT clock_timestamp()")
            wait_for(
                lambda: (
                    scalar(
                        conn, "SELECT count(*) FROM payhook.payment_outbox WHERE state = 'pending'"
                    )
                    == 0
                )
            )
            last = scalar(conn, "SELECT max(delivered_at) FROM payhook.payment_outbox")
            elapsed = (last - committed).total_seconds()
            attempts = scalar(conn, "SELECT sum(attempts) FROM payhook.payment_outbox")
            errors = conn.execute(
                "SELECT last_error, count(*) FROM payhook.payment_outbox"
                " WHERE last_error IS NOT NULL GROUP BY 1"
            ).fetchall()
            print(
                f"outbox    {args.workers} workers x {DEFAULT_CONCURRENCY} in flight, batch "
                f"{DEFAULT_BATCH}: {args.rows / elapsed:8.0f} deliveries/s "
                f"({args.rows} rows in {elapsed:.2f} s, {attempts} attempts; "
                f"{args.rows / elapsed / raw_rate:.0%} of the baseline)"
            )
            for error in errors:
                print(f"          retried after: {error['last_error']} x {error['count']}")

            # Latency: one row at a time, workers idle in between.
            tail = Tail(receiver.log)
            latencies = []
            for _ in range(args.samples):
                time.sleep(random.uniform(0.05, 0.15))
                [key] = rows.insert(1)
                committed_at = time.time()
                arrival = tail.wait_next()
                assert arrival["headers"]["idempotency-key"] == key
                latencies.append((arrival["t"] - committed_at) * 1000)
            p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
            print(
                f"latency   idle, commit to receiver ({args.samples} rows): "
                f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max(latencies):.1f} ms "
                f"(polling alone: ~{DEFAULT_POLL / 2 * 1000:.0f} ms average)"
            )
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    drop_database()


if __name__ == "__main__":
    main()
