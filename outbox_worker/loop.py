"""The claim / deliver / record loop of one worker process.

Each pass claims a batch (one committed statement), delivers the rows on a
thread pool with no transaction open, and records each result with a fenced
compare-and-set on its claim token. A row is only started while enough of its
lease remains for the delivery to finish inside it, so no row is sent twice
within one lease.

When nothing is due the loop sleeps until a `NOTIFY payhook_outbox` (sent by
the insert trigger when the consumer commits), the next scheduled retry, or
the poll interval, whichever comes first.

`stop()` (SIGTERM) stops claiming; deliveries in flight finish and are
recorded, claimed rows not yet started are released, then `run` returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import httpx
import psycopg
import structlog
from psycopg import sql
from redis import Redis
from structlog.typing import FilteringBoundLogger

from outbox_worker import claims
from outbox_worker.backoff import retry_delay
from outbox_worker.claims import Claim, StaleClaim
from outbox_worker.config import OutboxSettings
from outbox_worker.deadline import within
from outbox_worker.handlers import Outcome, deliver
from payhook.db import Pool, Row, pooled_connection
from payhook.flow import COMMIT_TO_DELIVERY, FlowRecorder
from payhook.sealing import Keyring

log = structlog.get_logger(__name__)

#: The channel the `payment_outbox` insert trigger notifies.
CHANNEL = "payhook_outbox"
#: Seconds the listener blocks before checking whether the worker is stopping.
LISTEN_TICK = 0.5
#: Seconds of the shortest idle wait, so rows another worker is claiming right
#: now do not make this one spin.
MIN_IDLE_WAIT = 0.05
#: Seconds to wait after the database failed before trying again; doubles to the max.
DB_RETRY_DELAY = 0.5
DB_RETRY_DELAY_MAX = 15.0

Deliver = Callable[[httpx.Client, Claim], Outcome]
Connect = Callable[[], psycopg.Connection[Row]]


class Worker:
    """Claims, delivers and records outbox rows until stopped."""

    def __init__(
        self,
        pool: Pool,
        client: httpx.Client,
        config: OutboxSettings,
        *,
        keyring: Keyring,
        listen: Connect | None = None,
        deliver: Deliver = deliver,
        redis: Redis | None = None,
    ) -> None:
        self.pool = pool
        #: Commit-to-delivery times, added to Redis for `/metrics` (`payhook.flow`).
        self.flow = FlowRecorder(COMMIT_TO_DELIVERY)
        self.redis = redis
        #: Opens tenants' sealed signing secrets.
        self.keyring = keyring
        self.client = client
        self.config = config
        self.listen = listen
        self.deliver = deliver
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self.executor = ThreadPoolExecutor(config.concurrency, thread_name_prefix="delivery")

    def stop(self) -> None:
        """Stop claiming: deliveries in flight finish, rows not yet started are released."""
        self.stopping.set()
        self.wake.set()

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        if self.redis is not None:
            self.flow.flush(self.redis)

    def run(self) -> None:
        """Deliver until `stop()`."""
        listener = None
        if self.listen is not None:
            listener = threading.Thread(target=self._listen, name="outbox-listen", daemon=True)
            listener.start()
        failures = 0
        while not self.stopping.is_set():
            self.wake.clear()
            try:
                claimed = self.run_batch()
                self.flow.flush_due(self.redis)
                if not claimed:
                    self._idle_wait()
                failures = 0
            except psycopg.OperationalError as exc:
                failures += 1
                delay = min(DB_RETRY_DELAY * 2 ** (failures - 1), DB_RETRY_DELAY_MAX)
                log.error(
                    "outbox_database_error", error=claims.short_error(str(exc)), retry_in=delay
                )
                self.stopping.wait(delay)
        if listener is not None:
            listener.join(timeout=LISTEN_TICK * 4)

    def run_once(self) -> int:
        """Deliver what is due now, then return how many rows were claimed."""
        total = 0
        while not self.stopping.is_set():
            claimed = self.run_batch()
            if not claimed:
                break
            total += claimed
        return total

    def run_batch(self) -> int:
        """Claim one batch and see every row to a recorded result; the number claimed."""
        started = time.monotonic()
        with pooled_connection(self.pool) as conn:
            batch = claims.claim_due_rows(conn, self.config.batch, self.config.lease, self.keyring)
        if not batch:
            return 0
        # The lease began no earlier than `started` on the database's clock too.
        deadline = started + self.config.lease
        futures = [self.executor.submit(self._process, claim, deadline) for claim in batch]
        for future in wait(futures).done:
            exc = future.exception()
            if exc is not None:
                # The row stays claimed; it is due again when its lease ends.
                log.error(
                    "outbox_record_failed", error=claims.short_error(f"{type(exc).__name__}: {exc}")
                )
        return len(batch)

    def _process(self, claim: Claim, deadline: float) -> None:
        dlog = log.bind(
            outbox_id=claim.id,
            tenant_id=claim.tenant_id,
            event_id=claim.event_id,
            action=claim.action,
            attempt=claim.attempts,
        )
        if self.stopping.is_set() or deadline - time.monotonic() < self._budget() + self._margin():
            self._release(claim, dlog)
            return
        began = time.monotonic()
        if claim.attempts > self.config.max_attempts:
            # The previous holder was lost during the last allowed attempt.
            outcome = Outcome("dead", "none", error="worker lost during the last attempt")
        else:
            try:
                # The exchange ends inside the budget the lease was checked for.
                with within(began + self._budget()):
                    outcome = self.deliver(self.client, claim)
            except Exception as exc:
                # A handler bug must not strand the row until its lease ends.
                dlog.exception("outbox_handler_failed")
                outcome = Outcome("retry", "none", error=f"handler failed: {type(exc).__name__}")
        duration_ms = round((time.monotonic() - began) * 1000, 1)
        self._record(claim, outcome, dlog.bind(duration_ms=duration_ms))

    def _budget(self) -> float:
        """Seconds of lease a delivery may take: twice the timeout, enforced as a
        deadline on the whole exchange (`outbox_worker.deadline`)."""
        return 2 * self.config.timeout

    def _margin(self) -> float:
        """Seconds of lease kept past the delivery's budget to record its result:
        a result recorded after the lease ended is refused as stale, and the
        row, delivered, is sent again by the worker that took it over. Half
        the timeout: the lease is at least three timeouts, so the first rows
        of a batch always start."""
        return self.config.timeout / 2

    def _record(self, claim: Claim, outcome: Outcome, dlog: FilteringBoundLogger) -> None:
        dlog = dlog.bind(handler=outcome.handler, status=outcome.status)
        try:
            with pooled_connection(self.pool) as conn:
                if outcome.kind == "delivered":
                    claims.mark_delivered(conn, claim)
                    dlog.info("outbox_delivered")
                    if claim.created_at is not None:
                        waited = time.time() - claim.created_at.timestamp()
                        self.flow.observe(claim.gateway or "unknown", waited)
                elif outcome.kind == "retry" and claim.attempts < self.config.max_attempts:
                    delay = retry_delay(
                        claim.attempts,
                        self.config.backoff,
                        self.config.backoff_max,
                        retry_after=outcome.retry_after,
                    )
                    claims.schedule_retry(conn, claim, delay, outcome.error or "failed")
                    dlog.warning(
                        "outbox_retry_scheduled", error=outcome.error, retry_in=round(delay, 3)
                    )
                else:
                    error = outcome.error or "failed"
                    if outcome.kind == "retry":
                        error = f"gave up after {claim.attempts} attempts: {error}"
                    claims.mark_dead(conn, claim, error)
                    dlog.error("outbox_dead", error=error)
        except StaleClaim:
            # Another worker holds the row now; its result is the one that counts.
            dlog.warning("outbox_claim_stale", outcome=outcome.kind)

    def _release(self, claim: Claim, dlog: FilteringBoundLogger) -> None:
        with pooled_connection(self.pool) as conn:
            released = claims.release(conn, claim)
        dlog.info("outbox_released", released=released, stopping=self.stopping.is_set())

    def _idle_wait(self) -> None:
        wait_for = self.config.poll
        with pooled_connection(self.pool) as conn:
            due_in = claims.seconds_until_due(conn)
        if due_in is not None:
            wait_for = min(wait_for, max(due_in, MIN_IDLE_WAIT))
        self.wake.wait(wait_for)

    def _listen(self) -> None:
        """Set `wake` on every notification; reconnect when the connection is lost."""
        assert self.listen is not None
        failures = 0
        while not self.stopping.is_set():
            try:
                with self.listen() as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))
                    failures = 0
                    # Rows committed while we were not listening are due now.
                    self.wake.set()
                    while not self.stopping.is_set():
                        for _ in conn.notifies(timeout=LISTEN_TICK, stop_after=1):
                            self.wake.set()
            except psycopg.Error as exc:
                # Polling still delivers; notifications resume once reconnected.
                failures += 1
                delay = min(DB_RETRY_DELAY * 2 ** (failures - 1), DB_RETRY_DELAY_MAX)
                log.warning(
                    "outbox_listen_lost", error=claims.short_error(str(exc)), retry_in=delay
                )
                self.stopping.wait(delay)
