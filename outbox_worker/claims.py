"""Claiming outbox rows under a lease, and recording results fenced by the claim token.

A claim is one short autocommit statement: due rows are locked with
`FOR UPDATE SKIP LOCKED`, given a fresh claim token and a lease, and the
statement commits before any delivery starts. Every later write about the row
is a compare-and-set on that token, so a worker whose lease ran out and whose
row was taken over cannot overwrite what the new holder records.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from payhook.db import Row, execute, fetch_all, fetch_one, tenant_transaction
from payhook.errors import PayhookError
from payhook.sealing import Keyring, SealingError, tenant_aad
from payhook.settings import Secret

#: Longest `last_error` stored, in characters.
MAX_ERROR_LENGTH = 300


class StaleClaim(PayhookError):
    """The claim token no longer matches: the row was taken over or already completed."""


@dataclass(frozen=True)
class Claim:
    """One claimed outbox row and what delivering it needs."""

    tenant_id: str
    id: str
    order_id: str
    event_id: str
    action: str
    payload: dict[str, Any]
    #: Attempts including this one.
    attempts: int
    token: str
    claimed_until: datetime
    #: Null: the tenant has no URL and the log handler records the effect.
    fulfilment_url: str | None
    #: Null when the tenant no longer exists, or its secret does not open.
    signing_secret: Secret | None
    #: Why the tenant's sealed secret did not open (names the key, never the secret).
    secret_error: str | None = None
    #: When the row was written (its event's commit), and the event's gateway.
    created_at: datetime | None = None
    gateway: str | None = None

    @property
    def idempotency_key(self) -> str:
        """`{tenant_id}:{event_id}:{action}`: the same on every attempt, from every worker."""
        return f"{self.tenant_id}:{self.event_id}:{self.action}"

    def key(self) -> dict[str, str]:
        """The parameters that fence a write to this claim."""
        return {"tenant_id": self.tenant_id, "id": self.id, "claim_token": self.token}


def claim_due_rows(
    conn: psycopg.Connection[Row], batch: int, lease: float, keyring: Keyring
) -> list[Claim]:
    """Claim up to `batch` due rows for `lease` seconds; committed when this
    returns. Each tenant's sealed signing secret is opened with `keyring`."""
    rows = fetch_all(conn, "claim_outbox_rows", {"batch": batch, "lease": lease})
    return [_claim(row, keyring) for row in rows]


def mark_delivered(conn: psycopg.Connection[Row], claim: Claim) -> None:
    """Record success; `StaleClaim` when the token is no longer the row's."""
    _fenced(conn, "mark_outbox_delivered", claim, {})


def schedule_retry(conn: psycopg.Connection[Row], claim: Claim, delay: float, error: str) -> None:
    """Record a failed attempt; the row is due again after `delay` seconds."""
    _fenced(conn, "schedule_outbox_retry", claim, {"delay": delay, "error": short_error(error)})


def mark_dead(conn: psycopg.Connection[Row], claim: Claim, error: str) -> None:
    """Record a permanent failure; the row waits for an operator."""
    _fenced(conn, "mark_outbox_dead", claim, {"error": short_error(error)})


def release(conn: psycopg.Connection[Row], claim: Claim) -> bool:
    """Give back a row that was never attempted; False when the claim was already stale."""
    with tenant_transaction(conn, claim.tenant_id):
        return execute(conn, "release_outbox_claim", claim.key()) == 1


def seconds_until_due(conn: psycopg.Connection[Row]) -> float | None:
    """Seconds until the earliest pending row is due (<= 0: now); None when none is pending."""
    row = fetch_one(conn, "next_outbox_due")
    if row is None or row["seconds"] is None:
        return None
    return float(row["seconds"])


def short_error(error: str) -> str:
    """One line, at most `MAX_ERROR_LENGTH` characters."""
    line = " ".join(error.split())
    return line if len(line) <= MAX_ERROR_LENGTH else line[: MAX_ERROR_LENGTH - 3] + "..."


def _fenced(conn: psycopg.Connection[Row], name: str, claim: Claim, params: dict[str, Any]) -> None:
    with tenant_transaction(conn, claim.tenant_id):
        touched = execute(conn, name, claim.key() | params)
    if touched != 1:
        raise StaleClaim(f"outbox row {claim.id}: claim {claim.token} is no longer current")


def _claim(row: Row, keyring: Keyring) -> Claim:
    secret, error = row["signing_secret"], None
    if secret is not None:
        try:
            secret = keyring.open(secret, tenant_aad(str(row["tenant_id"])))
        except SealingError as exc:
            secret, error = None, str(exc)
    return Claim(
        tenant_id=str(row["tenant_id"]),
        id=str(row["id"]),
        order_id=str(row["order_id"]),
        event_id=row["event_id"],
        action=row["action"],
        payload=dict(row["payload"]),
        attempts=int(row["attempts"]),
        token=str(row["claim_token"]),
        claimed_until=row["claimed_until"],
        fulfilment_url=row["fulfilment_url"],
        signing_secret=Secret(secret) if secret is not None else None,
        secret_error=error,
        created_at=row.get("created_at"),
        gateway=row.get("gateway"),
    )
