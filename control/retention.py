"""Retention: old receipts move to the archive, old bookkeeping is deleted.

    payhook retention run [--dry-run]

Receipts received more than PAYHOOK_RECEIPT_RETENTION ago move to
`payment_event_receipts_archive`, which keeps only the tenant, the event id,
the payload digest, the outcome and the timestamps: enough for the consumer
to recognise a redelivery as a duplicate for as long as the archive exists.
Delivered outbox rows, resolved exceptions and security anomalies are deleted
after their own retention. Open exceptions, pending and dead outbox rows are
never deleted, and a receipt whose exception is open stays live.

A run takes its cutoffs once, from the database's clock, and every batch
(or the dry run's count) compares with those: the horizons it reports are
exactly the ones it used, however long it runs. Every batch is one short
transaction that takes its rows with `FOR UPDATE SKIP LOCKED`, so a run never
waits for a consumer, never makes a consumer wait for more than one batch,
and several runs may overlap.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import structlog

from control import audit
from control.alerts import AlertSettings
from payhook.db import Row, connect, fetch_one
from payhook.errors import SettingsError
from payhook.horizon import describe
from payhook.settings import Settings

log = structlog.get_logger(__name__)

#: How long a retention statement may wait for a lock (DDL in progress).
LOCK_TIMEOUT = "1s"
#: How long one retention batch may run.
STATEMENT_TIMEOUT = "60s"


@dataclass(frozen=True)
class RetentionRun:
    """What one run moved or deleted (or, dry, would)."""

    dry_run: bool
    receipts_archived: int
    outbox_deleted: int
    exceptions_deleted: int
    anomalies_deleted: int
    batches: int
    #: The cutoffs, as ISO timestamps: rows older than these were eligible.
    horizons: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def retention_seconds(settings: Settings) -> dict[str, float]:
    """How long each kind of row is kept, in seconds, by the name a run reports it under."""
    return {
        "receipts": settings.receipt_retention,
        "outbox": settings.outbox_retention,
        "exceptions": settings.exception_retention,
        "anomalies": settings.anomaly_retention,
    }


def _check_anomaly_retention(settings: Settings) -> None:
    """An anomaly keeps its alert on for `PAYHOOK_ALERT_WINDOW`: deleting it
    sooner would silence the alert, so such a setting stops the run."""
    window = AlertSettings.from_settings(settings).window
    if settings.anomaly_retention < window:
        raise SettingsError(
            f"PAYHOOK_ANOMALY_RETENTION: {describe(settings.anomaly_retention)} is shorter than "
            f"PAYHOOK_ALERT_WINDOW ({describe(window)}): anomalies would be deleted while their "
            f"alert is due; use at least {describe(window)}"
        )


def retention_cutoffs(conn: psycopg.Connection[Row], settings: Settings) -> dict[str, datetime]:
    """Each kind's cutoff, in UTC: the database's `now` minus its retention.
    Rows older than their cutoff are eligible."""
    clock = fetch_one(conn, "database_now")
    assert clock is not None
    now = clock["now"].astimezone(UTC)
    return {k: now - timedelta(seconds=v) for k, v in retention_seconds(settings).items()}


def run_retention(
    conn: psycopg.Connection[Row], settings: Settings, *, dry_run: bool = False
) -> RetentionRun:
    """Archive old receipts and delete old bookkeeping, batch by batch."""
    _check_anomaly_retention(settings)
    # Taken once: every batch compares with these, and they are what the run reports.
    cutoffs = retention_cutoffs(conn, settings)
    horizons = {k: v.isoformat() for k, v in cutoffs.items()}
    if dry_run:
        counts = fetch_one(conn, "count_expired", cutoffs)
        assert counts is not None
        return RetentionRun(
            True,
            counts["receipts"],
            counts["outbox"],
            counts["exceptions"],
            counts["anomalies"],
            0,
            horizons,
        )
    batch = settings.retention_batch
    batches = 0
    archived = 0
    while True:
        with conn.transaction():
            row = fetch_one(
                conn, "archive_receipts", {"cutoff": cutoffs["receipts"], "batch": batch}
            )
        assert row is not None
        batches += 1
        archived += row["archived"]
        if row["moved"] < batch:
            break
    deleted = {}
    for name, statement in (
        ("outbox", "delete_delivered_outbox"),
        ("exceptions", "delete_resolved_exceptions"),
        ("anomalies", "delete_old_anomalies"),
    ):
        deleted[name] = 0
        while True:
            with conn.transaction():
                found = fetch_one(conn, statement, {"cutoff": cutoffs[name], "batch": batch})
                count = 0 if found is None else int(found["deleted"])
            batches += 1
            deleted[name] += count
            if count < batch:
                break
    result = RetentionRun(
        False,
        archived,
        deleted["outbox"],
        deleted["exceptions"],
        deleted["anomalies"],
        batches,
        horizons,
    )
    log.info(
        "retention_done",
        **{k: v for k, v in result.to_json().items() if k not in {"horizons", "dry_run"}},
    )
    return result


def run(args: argparse.Namespace, settings: Settings) -> int:
    """`payhook retention run [--dry-run]`: print what was (or would be) moved and deleted."""
    options = f"-c lock_timeout={LOCK_TIMEOUT} -c statement_timeout={STATEMENT_TIMEOUT}"
    with connect(settings, "retention", options=options) as conn:
        result = run_retention(conn, settings, dry_run=args.dry_run)
        if not args.dry_run:
            audit.record(conn, "retention_run", "retention", "*", result=result.to_json())
    print(json.dumps(result.to_json()))
    return 0
