"""A consumer worker for the benchmark: the real one, or a no-op ceiling.

python -m bench.consumer_worker apply|noop simple|alone|fork|stock [CPU_FILE]

`simple` is payhook's worker (`PayhookWorker`, taking PAYHOOK_CONSUMER_BATCH
jobs at a time), `alone` the same worker committing each event of a batch in
a transaction of its own (no group commit), `fork` RQ's forking `Worker`,
`stock` RQ's own `SimpleWorker` as shipped (no-op jobs only).

With CPU_FILE, the worker writes there the CPU seconds it spent working
(dequeueing and running jobs until the queue was empty), start-up excluded.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from rq.serializers import JSONSerializer
from rq.worker import BaseWorker, SimpleWorker, Worker

from consumer import handler
from consumer.applier import Applier
from consumer.handler import Runtime
from consumer.worker import ALLOWED_FUNCTIONS, PayhookJob, PayhookWorker
from payhook.db import create_pool
from payhook.logs import configure_logging
from payhook.queue import events_queue, redis_connection
from payhook.settings import Settings

NOOP = "bench.consumer_worker.noop"


def noop(envelope: Any) -> dict[str, Any]:
    """Does nothing with a job of the same shape as a real one."""
    return {"outcome": "noop"}


class BenchJob(PayhookJob):
    allowed_functions = ALLOWED_FUNCTIONS | {NOOP}


class ForkingWorker(Worker):
    """RQ's default worker: a forked work horse per job."""

    job_class = BenchJob


class SimpleBenchWorker(PayhookWorker):
    job_class = BenchJob


def _one_by_one(conn: Any, calls: Any) -> Any:
    raise psycopg.errors.DeadlockDetected("bench: no group commit")


def main(mode: str, kind: str, cpu_file: str | None = None) -> int:
    settings = Settings.from_env(os.environ)
    configure_logging(settings.log_level)
    if mode == "apply":
        pool = create_pool(settings, "bench", size=2)
        pool.open(wait=True)
        runtime = Runtime(settings=settings, pool=pool)
    if kind == "alone":
        # Every batch's transaction "fails" before it is sent: each event is
        # applied in a transaction of its own, as `handle_many` falls back.
        setattr(handler, "apply_events", _one_by_one)  # noqa: B010
    connection = redis_connection(settings)
    worker: BaseWorker
    if kind == "stock":
        if mode != "noop":
            raise SystemExit("RQ's stock SimpleWorker runs no-op jobs only")
        worker = SimpleWorker(
            [events_queue(connection, settings)], connection=connection, serializer=JSONSerializer
        )
    else:
        payhook = kind in ("simple", "alone")
        cls = SimpleBenchWorker if payhook else ForkingWorker
        worker = cls(
            [settings.queue] if payhook else [events_queue(connection, settings)],
            connection=connection,
            serializer=JSONSerializer,
            job_class=BenchJob,
        )
    worker.log_job_description = False
    if isinstance(worker, PayhookWorker):
        worker.batch_size = settings.consumer_batch
    if mode == "apply" and isinstance(worker, PayhookWorker):
        worker.applier = Applier(runtime)
    started = time.process_time()
    worker.work(burst=True, logging_level="ERROR")
    if cpu_file:
        Path(cpu_file).write_text(str(time.process_time() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
