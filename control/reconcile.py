"""`payhook reconcile`: queue the events a gateway's API lists that payhook never received.

Webhooks are not guaranteed: a gateway gives up, or never sends. For a
gateway whose API lists its events (`payhook.gateways.base.EventSource`,
Stripe's `GET /v1/events`), a run lists those created in a window, newest
first, page by page, and queues every event of a type payhook acts on that
has no receipt, live or archived, through the same consumer path as a
webhook.

A listed event was fetched over TLS with the merchant's key, not signed by
the gateway for this endpoint: its job carries the proof a batch's events
carry (`payhook.envelope.part_proof`, keyed with the endpoint's secret,
which only payhook holds), so a job forged in Redis still cannot pass as
one. The same event arriving later as a webhook has the same id and the
same meaning: a `duplicate`.

Each run is a row of `payhook.reconcile_runs`: its window, how many events
it listed, found missing and queued, and its cursor, the last event listed.
A `429` is waited out as its `Retry-After` asks; other failures are retried
a few times, then end the run with its error, and the next run of the
endpoint resumes from the cursor (`--restart` lists the window anew).
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import structlog
from redis import Redis
from redis.exceptions import RedisError

from payhook.db import Row, connect, execute, fetch_all, fetch_one, tenant_transaction
from payhook.endpoints import open_credentials, open_secrets
from payhook.envelope import Envelope, Part, part_proof
from payhook.errors import GatewayUnavailable, NotFound, PayhookError, RateLimited
from payhook.gateways import GATEWAYS, get_gateway
from payhook.gateways.base import Config, EventSource
from payhook.gateways.storable import storable_event_id
from payhook.queue import enqueue_event, events_queue, redis_connection
from payhook.sealing import Keyring
from payhook.settings import Settings, positive_duration

log = structlog.get_logger(__name__)

#: Attempts at one page after a failure other than a 429, and after 429s.
FAILURE_ATTEMPTS = 3
RATE_LIMIT_ATTEMPTS = 10
#: Seconds waited after a failure (doubled each time), and at most for a 429.
BACKOFF = 1.0
MAX_WAIT = 60.0


@dataclass
class Run:
    """One run, as `payhook reconcile` prints it and `reconcile_runs` keeps it."""

    id: str
    endpoint_id: str
    window_start: datetime
    window_end: datetime
    dry_run: bool
    listed: int = 0
    missing: int = 0
    queued: int = 0
    cursor: str | None = None
    error: str | None = None
    tenant_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["window_start"] = self.window_start.isoformat()
        data["window_end"] = self.window_end.isoformat()
        return data


def reconcile(
    conn: psycopg.Connection[Row],
    redis: Redis,
    settings: Settings,
    endpoint_id: str,
    since: timedelta,
    *,
    keyring: Keyring,
    dry_run: bool = False,
    restart: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> Run:
    """One run for `endpoint_id` over the last `since`; the run as it ended."""
    row = fetch_one(conn, "get_endpoint", {"endpoint_id": endpoint_id})
    if row is None:
        raise NotFound(f"no endpoint {endpoint_id}")
    tenant_id, endpoint_id = str(row["tenant_id"]), str(row["id"])
    gateway = get_gateway(row["gateway"])
    if not isinstance(gateway, EventSource):
        raise PayhookError(f"--endpoint: a {gateway.name} endpoint's API lists no events")
    secrets = open_secrets(keyring, tenant_id, endpoint_id, row["secrets"])
    config = Config(
        row["settings"], open_credentials(keyring, tenant_id, endpoint_id, row["credentials"])
    )
    now = datetime.now(UTC)
    run = Run(str(uuid.uuid4()), endpoint_id, now - since, now, dry_run, tenant_id=tenant_id)
    with tenant_transaction(conn, tenant_id):
        last = fetch_one(
            conn, "last_reconcile_run", {"tenant_id": tenant_id, "endpoint_id": endpoint_id}
        )
        if last is not None and last["error"] and last["cursor"] and not restart:
            # Where the last run stopped, in its window.
            run.window_start, run.cursor = last["window_start"], last["cursor"]
        execute(conn, "insert_reconcile_run", _row(run, tenant_id) | {"finished": False})
    queue = events_queue(redis, settings)
    try:
        while True:
            page = _page(gateway, config, run, settings.gateway_timeout, sleep)
            if page is None:
                break
            _take(conn, queue, settings, gateway, tenant_id, secrets, run, page.events)
            if page.events:
                run.cursor = gateway.event_id_of(page.events[-1])
            _save(conn, tenant_id, run, finished=False)
            if not page.more:
                break
    finally:
        _save(conn, tenant_id, run, finished=True)
        log.info("reconcile_run", **run.to_json())
    return run


def _page(
    gateway: EventSource,
    config: Config,
    run: Run,
    timeout: float,
    sleep: Callable[[float], None],
) -> Any:
    """The next page, waiting out 429s and retrying failures; None, with the
    run's error set, when the API does not give it."""
    failures = rate_limited = 0
    while True:
        try:
            return gateway.list_events(config, run.window_start, run.cursor, timeout)
        except RateLimited as exc:
            rate_limited += 1
            if rate_limited >= RATE_LIMIT_ATTEMPTS:
                run.error = str(exc)
                return None
            sleep(min(exc.retry_after, MAX_WAIT))
        except GatewayUnavailable as exc:
            failures += 1
            if failures >= FAILURE_ATTEMPTS:
                run.error = str(exc)
                return None
            sleep(BACKOFF * 2 ** (failures - 1))


def _take(
    conn: psycopg.Connection[Row],
    queue: Any,
    settings: Settings,
    gateway: EventSource,
    tenant_id: str,
    secrets: tuple[str, ...],
    run: Run,
    events: list[dict[str, Any]],
) -> None:
    """Queue the events of a page payhook acts on and has no receipt of."""
    run.listed += len(events)
    acted = {storable_event_id(gateway.event_id_of(e)): e for e in events if gateway.acts_on(e)}
    if not acted:
        return
    with tenant_transaction(conn, tenant_id):
        rows = fetch_all(conn, "known_events", {"tenant_id": tenant_id, "event_ids": list(acted)})
    known = {r["event_id"] for r in rows}
    for event_id, event in acted.items():
        if event_id in known:
            continue
        run.missing += 1
        log.warning("reconcile_missing_event", event_id=event_id, run_id=run.id)
        if run.dry_run or not secrets:
            continue
        body = json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
        proof = part_proof(secrets[0], run.endpoint_id, run.id, 0, 1, body)
        envelope = Envelope(
            endpoint_id=run.endpoint_id,
            body=body,
            headers={},
            received_at=datetime.now(UTC),
            delivery_id=str(uuid.uuid4()),
            part=Part(run.id, 0, 1, proof),
        )
        enqueue_event(queue, envelope, settings)
        run.queued += 1


def _row(run: Run, tenant_id: str) -> dict[str, Any]:
    return {
        "tenant_id": tenant_id,
        "id": run.id,
        "endpoint_id": run.endpoint_id,
        "window_start": run.window_start,
        "window_end": run.window_end,
        "dry_run": run.dry_run,
        "listed": run.listed,
        "missing": run.missing,
        "queued": run.queued,
        "cursor": run.cursor,
        "error": run.error,
    }


def _save(conn: psycopg.Connection[Row], tenant_id: str, run: Run, *, finished: bool) -> None:
    with tenant_transaction(conn, tenant_id):
        execute(conn, "update_reconcile_run", _row(run, tenant_id) | {"finished": finished})


def reconcilable(conn: psycopg.Connection[Row]) -> list[str]:
    """Every endpoint whose gateway lists its events and that has an API key."""
    rows = fetch_all(conn, "list_endpoints")
    return sorted(
        str(row["id"])
        for row in rows
        if row["id"] is not None
        and row["gateway"] in GATEWAYS
        and isinstance(GATEWAYS[row["gateway"]], EventSource)
        and "api_key" in row["credentials"]
    )


def reconcile_all(
    conn: psycopg.Connection[Row],
    redis: Redis,
    settings: Settings,
    since: timedelta,
    *,
    keyring: Keyring,
    dry_run: bool = False,
) -> list[Run]:
    """One run for every endpoint that can be reconciled; one failing does not
    stop the others."""
    done = []
    for endpoint_id in reconcilable(conn):
        try:
            done.append(
                reconcile(
                    conn, redis, settings, endpoint_id, since, keyring=keyring, dry_run=dry_run
                )
            )
        except PayhookError as exc:
            log.error("reconcile_failed", endpoint_id=endpoint_id, error=str(exc))
    return done


def every(settings: Settings) -> float | None:
    """`PAYHOOK_RECONCILE_EVERY` in seconds; None when reconciliation is off."""
    raw = settings.get("PAYHOOK_RECONCILE_EVERY")
    if raw is None or raw.strip() in ("", "0", "off"):
        return None
    return positive_duration("PAYHOOK_RECONCILE_EVERY", raw)


def runs(conn: psycopg.Connection[Row], endpoint_id: str, limit: int = 20) -> list[dict[str, Any]]:
    """The endpoint's latest runs, newest first."""
    row = fetch_one(conn, "get_endpoint", {"endpoint_id": endpoint_id})
    if row is None:
        raise NotFound(f"no endpoint {endpoint_id}")
    params = {"tenant_id": row["tenant_id"], "endpoint_id": row["id"], "limit": limit}
    with tenant_transaction(conn, row["tenant_id"]):
        return [
            {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in r.items()}
            | {"id": str(r["id"])}
            for r in fetch_all(conn, "list_reconcile_runs", params)
        ]


def run_scheduled(settings: Settings, since: timedelta, keyring: Keyring) -> int:
    """`payhook reconcile --scheduled`: every PAYHOOK_RECONCILE_EVERY, a run
    for every endpoint that can be reconciled, until SIGTERM or SIGINT; with
    the setting off, idle until then (a service of compose stays up)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    interval = every(settings)
    if interval is None:
        log.info("reconcile_off", reason="PAYHOOK_RECONCILE_EVERY is not set")
        stop.wait()
        return 0
    log.info("reconcile_scheduled", every_s=interval, since_s=since.total_seconds())
    while not stop.is_set():
        try:
            with connect(settings) as conn:
                redis = redis_connection(settings, timeout=10)
                try:
                    reconcile_all(conn, redis, settings, since, keyring=keyring)
                finally:
                    redis.close()
        except (psycopg.Error, RedisError, OSError) as exc:
            # The database or Redis away: the next pass tries again.
            log.error("reconcile_pass_failed", error=f"{exc.__class__.__name__}: {exc}")
        stop.wait(interval)
    return 0
