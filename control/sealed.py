"""`payhook secrets seal|rotate-key|check`: the stored secrets under the current key.

Sealing plaintext left by an older release and rotating to a new key are one
operation: every secret not sealed under the current key is (re)sealed under
it. It runs in small transactions, each locking a batch of rows with
`FOR UPDATE SKIP LOCKED`, so no table is locked for long and the processes go
on meanwhile; interrupted, it is run again and goes on with what is left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
import structlog
from psycopg.types.json import Jsonb

from payhook.db import Row, execute, fetch_all, fetch_one
from payhook.sealing import (
    PREFIX,
    Keyring,
    SealingError,
    credential_aad,
    endpoint_aad,
    is_sealed,
    tenant_aad,
)

log = structlog.get_logger(__name__)

#: Rows one transaction reseals.
DEFAULT_BATCH = 100
#: Passes over the tables before giving up on rows other transactions keep locked.
MAX_PASSES = 5
#: Seconds between passes, for those locks to be released.
PASS_DELAY = 0.5


@dataclass
class SealReport:
    """What a run of `reseal_all` did and what it left."""

    #: Rows (tenants and endpoints) written.
    resealed: int = 0
    #: Places whose secret does not open with the configured keys: `table id: why`.
    failures: list[str] = field(default_factory=list)
    #: Tenants and endpoints still holding a secret not under the current key.
    remaining: int = 0


@dataclass
class CheckReport:
    """What `check_all` found."""

    #: Secrets that opened.
    opened: int = 0
    #: Secrets stored as plaintext (written before sealing, not sealed since).
    plaintext: list[str] = field(default_factory=list)
    #: Secrets that do not open: `table id: why`.
    failures: list[str] = field(default_factory=list)
    #: Secrets by the id of the key that sealed them.
    by_key: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.plaintext and not self.failures


def reseal_all(
    conn: psycopg.Connection[Row],
    keyring: Keyring,
    batch: int = DEFAULT_BATCH,
    *,
    plaintext_only: bool = False,
    stop_after: int | None = None,
) -> SealReport:
    """Seal every stored secret not sealed under the current key (with
    `plaintext_only`, every row holding plaintext), `batch` rows per
    transaction. `stop_after` ends the run after that many transactions
    (tests interrupt it so)."""
    current = keyring.sealing_prefix()  # without a key, raises before any row is locked
    prefix = PREFIX if plaintext_only else current
    report = SealReport()
    transactions = 0
    for attempt in range(MAX_PASSES):
        failed: set[str] = set()
        for kind in ("tenants", "endpoints"):
            after: Any = None
            while stop_after is None or transactions < stop_after:
                with conn.transaction():
                    rows = fetch_all(
                        conn,
                        f"lock_{kind}_to_seal",
                        {"after": after, "prefix": prefix, "batch": batch},
                    )
                    for row in rows:
                        _reseal_row(conn, keyring, kind, row, report, failed)
                transactions += 1
                if len(rows) < batch:
                    break
                after = rows[-1]["id"]
        report.failures = sorted(failed)
        report.remaining = _remaining(conn, prefix)
        if stop_after is not None and transactions >= stop_after:
            break
        if report.remaining <= _rows_failed(failed) or attempt == MAX_PASSES - 1:
            break
        time.sleep(PASS_DELAY)  # rows skipped while locked: their turn on the next pass
    return report


def _reseal_row(
    conn: psycopg.Connection[Row],
    keyring: Keyring,
    kind: str,
    row: Row,
    report: SealReport,
    failed: set[str],
) -> None:
    place = f"{kind} {row['id']}"
    try:
        if kind == "tenants":
            aad = tenant_aad(str(row["id"]))
            sealed = keyring.reseal(row["signing_secret"], aad)
            execute(conn, "set_tenant_secret", {"id": row["id"], "signing_secret": sealed})
        else:
            aad = endpoint_aad(str(row["tenant_id"]), str(row["id"]))
            secrets = [None if s is None else keyring.reseal(s, aad) for s in row["secrets"]]
            retired = [
                r | {"secret": keyring.reseal(r["secret"], aad)}
                if isinstance(r.get("secret"), str)
                else r
                for r in row["retired_secrets"]
            ]
            tenant_id, endpoint_id = str(row["tenant_id"]), str(row["id"])
            credentials = {
                name: keyring.reseal(value, credential_aad(tenant_id, endpoint_id, name))
                for name, value in row["credentials"].items()
            }
            execute(
                conn,
                "set_endpoint_secrets",
                {
                    "tenant_id": row["tenant_id"],
                    "id": row["id"],
                    "secrets": secrets,
                    "retired_secrets": Jsonb(retired),
                    "credentials": Jsonb(credentials),
                },
            )
    except SealingError as exc:
        failed.add(f"{place}: {exc}")
        log.error("secret_reseal_failed", table=kind, id=str(row["id"]), error=str(exc))
        return
    report.resealed += 1


def _rows_failed(failed: set[str]) -> int:
    return len({entry.split(":", 1)[0] for entry in failed})


def _remaining(conn: psycopg.Connection[Row], prefix: str) -> int:
    row = fetch_one(conn, "count_secrets_to_seal", {"prefix": prefix})
    assert row is not None
    return int(row["tenants"]) + int(row["endpoints"])


def check_all(
    conn: psycopg.Connection[Row], keyring: Keyring, batch: int = DEFAULT_BATCH
) -> CheckReport:
    """Open every stored secret; report plaintext and values that do not open."""
    report = CheckReport()
    for kind in ("tenants", "endpoints"):
        after: Any = None
        while True:
            rows = fetch_all(conn, f"list_{kind}_secrets", {"after": after, "batch": batch})
            for row in rows:
                if kind == "tenants":
                    aad = tenant_aad(str(row["id"]))
                    values = [row["signing_secret"]]
                else:
                    aad = endpoint_aad(str(row["tenant_id"]), str(row["id"]))
                    values = list(row["secrets"]) + [
                        r["secret"]
                        for r in row["retired_secrets"]
                        if isinstance(r.get("secret"), str)
                    ]
                for value in values:
                    if value is not None:
                        _check_value(report, keyring, f"{kind} {row['id']}", value, aad)
                for name, value in row.get("credentials", {}).items():
                    aad = credential_aad(str(row["tenant_id"]), str(row["id"]), name)
                    place = f"{kind} {row['id']} credential {name}"
                    _check_value(report, keyring, place, value, aad)
            if len(rows) < batch:
                break
            after = rows[-1]["id"]
    return report


def _check_value(report: CheckReport, keyring: Keyring, place: str, value: str, aad: str) -> None:
    if not is_sealed(value):
        report.plaintext.append(place)
        return
    try:
        keyring.open(value, aad)
    except SealingError as exc:
        report.failures.append(f"{place}: {exc}")
        return
    report.opened += 1
    key_id = value.split(":", 3)[2]
    report.by_key[key_id] = report.by_key.get(key_id, 0) + 1
