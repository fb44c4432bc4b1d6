"""Wiring of a consumer process: settings, logging, pool, Redis, worker."""

from __future__ import annotations

import time

import psycopg
import structlog
from rq.serializers import JSONSerializer

from consumer.applier import Applier
from consumer.handler import Runtime
from consumer.worker import PayhookWorker, job_class_for
from payhook.db import Pool, create_pool, error_summary, pooled_connection
from payhook.logs import configure_logging
from payhook.outcomes import check_outcomes
from payhook.queue import redis_connection
from payhook.sealing import Keyring, require_key
from payhook.settings import Settings

log = structlog.get_logger(__name__)

#: Share of the job timeout one statement may take.
STATEMENT_SHARE = 0.8
#: Seconds between tries of the start-up check while PostgreSQL cannot answer
#: (each try also waits up to the pool's timeout for a connection).
CHECK_RETRY_DELAY = 1.0


def build_worker(settings: Settings, runtime: Runtime | None = None) -> PayhookWorker:
    """A worker on the events queue; with `runtime`, one that applies events."""
    connection = redis_connection(settings)
    # One queue per worker: RQ then moves each job atomically (BLMOVE) into
    # its intermediate list and can recover it after a crash.
    worker = PayhookWorker(
        [settings.queue],
        connection=connection,
        serializer=JSONSerializer,
        job_class=job_class_for(settings),
        maintenance_interval=settings.maintenance_interval,
    )
    worker.job_grace = settings.job_grace
    worker.faults = settings.faults
    worker.batch_size = settings.consumer_batch
    if runtime is not None:
        worker.applier = Applier(runtime)
    return worker


def run(settings: Settings, burst: bool = False) -> int:
    """Run one worker on the events queue until stopped (or the queue is empty, with burst)."""
    configure_logging(settings.log_level)
    # The server ends a statement (a lock wait included) before RQ's job
    # timeout would interrupt it: the job fails cleanly and RQ retries it.
    # (The replays of waiting events that may follow the event's commit wait
    # 2 s at most for a lock; an interruption there leaves the event applied.)
    pool = create_pool(
        settings, "consumer", size=2, statement_timeout=settings.job_timeout * STATEMENT_SHARE
    )
    pool.open(wait=False)
    try:
        check_schema(pool, Keyring.from_settings(settings))
        worker = build_worker(settings)
        applier = worker.applier = Applier(
            Runtime(settings=settings, pool=pool, redis=worker.connection)
        )
        try:
            log.info("consumer_started", queue=settings.queue, worker=worker.name, burst=burst)
            # The scheduler moves retried jobs back onto the queue after their interval.
            worker.work(burst=burst, with_scheduler=True, logging_level="WARNING")
        finally:
            applier.close()
    finally:
        pool.close()
    if not burst and not worker.stop_requested_by_signal:
        # RQ ended its loop on an error (logged above): exit so that a
        # supervisor restarts the consumer, rather than report success.
        log.error("consumer_stopped_unexpectedly", worker=worker.name)
        return 1
    return 0


def check_schema(pool: Pool, keyring: Keyring) -> None:
    """Refuse to start on a database whose lists of outcomes are not this
    release's (`OutcomesMismatch`), or whose secrets are sealed while no key
    is configured (`MissingKey`). While PostgreSQL cannot answer, wait for
    it: no job could be applied meanwhile, and one taken would spend its retries.
    """
    while True:
        try:
            with pooled_connection(pool) as conn:
                check_outcomes(conn)
                require_key(conn, keyring)
            return
        except psycopg.OperationalError as exc:
            log.warning("outcomes_check_waiting", error=error_summary(exc))
            time.sleep(CHECK_RETRY_DELAY)
