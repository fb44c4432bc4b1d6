"""Wiring of an outbox worker process: settings, logging, pool, HTTP client, signals."""

from __future__ import annotations

import logging
import signal
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import TypeVar

import httpx
import psycopg
import structlog

from outbox_worker import deadline, egress
from outbox_worker.config import OutboxSettings
from outbox_worker.loop import Worker
from payhook.db import Row, connect, create_pool, error_summary
from payhook.destinations import describe
from payhook.logs import configure_logging
from payhook.redis_client import sync_client
from payhook.sealing import Keyring, require_key
from payhook.settings import Settings

log = structlog.get_logger(__name__)

#: Seconds between looks for a stop signal noted by the handler.
SIGNAL_POLL = 0.1

T = TypeVar("T")


def build_client(config: OutboxSettings) -> httpx.Client:
    """One HTTP client per process, with a connection per concurrent delivery.

    Each delivery's exchange must end by its deadline (`outbox_worker.deadline`),
    except through a proxy the environment names (`HTTPS_PROXY` and the like):
    httpx's own transports carry those, and bound each step only. Either way
    it goes only where `config.destinations` allows (`outbox_worker.egress`),
    and never follows a redirect, which could lead anywhere.
    """
    limits = httpx.Limits(
        max_connections=config.concurrency, max_keepalive_connections=config.concurrency
    )
    timeout = httpx.Timeout(config.timeout)
    if environment_proxy():
        log.warning(
            "outbox_proxy_from_environment", deadline="per step only", destinations="not pinned"
        )
        hook = egress.check_request(config.destinations, resolve=True)
        return httpx.Client(
            timeout=timeout,
            limits=limits,
            follow_redirects=False,
            event_hooks={"request": [hook]},
        )
    return httpx.Client(
        timeout=timeout,
        transport=deadline.build_transport(limits, config.destinations),
        follow_redirects=False,
        event_hooks={"request": [egress.check_request(config.destinations)]},
    )


def environment_proxy() -> bool:
    """Whether httpx would take a proxy from the environment: it reads only
    `HTTP_PROXY`, `HTTPS_PROXY` and `ALL_PROXY` (lower case too), and
    `NO_PROXY=*` turns them all off. `NO_PROXY` alone, common in container
    images, names no proxy, and must not cost the deliveries their deadline."""
    found = urllib.request.getproxies()
    if "*" in (host.strip() for host in found.get("no", "").split(",")):
        return False
    return any(found.get(scheme) for scheme in ("http", "https", "all"))


def pool_size(settings: Settings, config: OutboxSettings) -> int:
    """A connection for every delivery thread and one for the claiming loop: a
    delivered row whose result waited for a connection and timed out would
    stay claimed, and be sent again when its lease ended."""
    return max(settings.db_pool_size, config.concurrency + 1)


def run(settings: Settings, once: bool = False) -> int:
    """Deliver outbox rows until SIGTERM (or, with `once`, until nothing is due)."""
    configure_logging(settings.log_level)
    # httpx logs every request with its full URL, which may carry credentials;
    # our own line per delivery says what happened without it.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = OutboxSettings.from_settings(settings)
    keyring = Keyring.from_settings(settings)
    check_key(settings, keyring)
    pool = create_pool(settings, "outbox-worker", size=pool_size(settings, config))
    client = build_client(config)

    def listen() -> psycopg.Connection[Row]:
        # A session of its own: past a transaction pooler, the direct URL's.
        return connect(settings, "outbox-listen", direct=True)

    listening = not once
    if settings.database_pooler == "transaction" and settings.database_direct_url is None:
        # LISTEN needs a session of its own: polling alone finds due rows.
        log.warning(
            "outbox_listen_off", reason="transaction pooler, no direct URL", poll=config.poll
        )
        listening = False

    # Only for the commit-to-delivery histogram (`payhook.flow`): deliveries
    # never wait for Redis, and go on without it.
    redis = sync_client(settings, socket_timeout=2, socket_connect_timeout=2)
    worker = Worker(
        pool, client, config, keyring=keyring, listen=listen if listening else None, redis=redis
    )

    stopped_by: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only note it. The signal may land while this thread holds a lock
        # (the log's, an Event's while it stops the loop after a first signal):
        # a handler that took it would wait for it forever.
        stopped_by.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pool.open(wait=False)
    log.info(
        "outbox_worker_started",
        once=once,
        lease=config.lease,
        batch=config.batch,
        concurrency=config.concurrency,
        max_attempts=config.max_attempts,
        insecure_fulfilment=config.destinations.allow_insecure,
        fulfilment_allow_networks=describe(config.destinations.allow_networks),
    )
    try:
        if once:
            claimed = until_stopped(worker.run_once, worker, stopped_by)
            log.info("outbox_pass_done", claimed=claimed)
        else:
            until_stopped(worker.run, worker, stopped_by)
            log.info("outbox_worker_stopping", signal=stopped_by[0] if stopped_by else None)
    finally:
        worker.close()
        redis.close()
        client.close()
        pool.close()
    log.info("outbox_worker_stopped")
    return 0


def check_key(settings: Settings, keyring: Keyring) -> None:
    """Refuse to start without a key while sealed secrets exist (`MissingKey`).
    With PostgreSQL away the check is left to the claims: a row whose
    tenant's secret does not open is retried with an error naming the setting."""
    if keyring:
        return
    try:
        with connect(settings, "outbox-worker") as conn:
            require_key(conn, keyring)
    except psycopg.OperationalError as exc:
        log.warning("secrets_key_check_skipped", error=error_summary(exc))


def until_stopped(loop: Callable[[], T], worker: Worker, stopped_by: list[str]) -> T:
    """Run `loop` on a thread of its own; this one, the one signals
    interrupt, asks the worker to stop once a signal was noted."""
    with ThreadPoolExecutor(1, thread_name_prefix="outbox-loop") as runner:
        running = runner.submit(loop)
        while True:
            if stopped_by:
                worker.stop()
            try:
                return running.result(timeout=SIGNAL_POLL)
            except TimeoutError:
                continue
