"""The operators' audit trail: one row per operator action, never changed.

Every command and dashboard button that changes payhook's state calls
`record` with who did it, what, on which object and with what result;
`payhook.operator_actions` (migration 0017) takes inserts only. The actor of
a command is `PAYHOOK_OPERATOR` if set (a name the operator gives), else the
system user running it; the dashboard's is its login user.
"""

from __future__ import annotations

import getpass
import json
import os
import uuid
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from payhook.db import Row, execute, fetch_all, fetch_one, tenant_of, tenant_transaction
from payhook.errors import PayhookError

#: Most actions one listing prints.
MAX_LIMIT = 10_000


def command_actor() -> str:
    """Who runs a command: `PAYHOOK_OPERATOR`, else the system user."""
    named = os.environ.get("PAYHOOK_OPERATOR", "").strip()
    if named:
        return named
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def record(
    conn: psycopg.Connection[Row],
    action: str,
    object_kind: str,
    object_id: str,
    *,
    tenant_id: str | None = None,
    event_id: str | None = None,
    note: str | None = None,
    result: dict[str, Any] | None = None,
    actor: str | None = None,
    source: str = "cli",
) -> None:
    """Write one action, in a transaction of its own under its tenant."""
    with tenant_transaction(conn, tenant_id):
        execute(
            conn,
            "insert_operator_action",
            {
                "actor": actor or command_actor(),
                "source": source,
                "action": action,
                "object_kind": object_kind,
                "object_id": object_id,
                "tenant_id": tenant_id,
                "event_id": event_id,
                "note": note,
                # What a command prints, times as text: JSON as it is shown.
                "result": Jsonb(json.loads(json.dumps(result or {}, default=str))),
            },
        )


def event_of(
    conn: psycopg.Connection[Row], kind: str, object_id: str
) -> tuple[str | None, str | None]:
    """The tenant and event of an exception (`kind` "exception") or an
    outbox row ("outbox"); (None, None) when there is no such object."""
    table = {"exception": "payment_exceptions", "outbox": "payment_outbox"}[kind]
    tenant_id = tenant_of(conn, table, object_id)
    if tenant_id is None:
        return None, None
    with tenant_transaction(conn, tenant_id):
        row = fetch_one(conn, f"{kind}_event", {"tenant_id": tenant_id, "id": object_id})
    return str(tenant_id), (row["event_id"] if row else None)


def actions(
    conn: psycopg.Connection[Row], tenant_id: str, event_id: str | None = None, limit: int = 50
) -> list[Row]:
    """A tenant's actions, newest first; those about one event with `event_id`."""
    try:
        tenant_id = str(uuid.UUID(tenant_id))
    except ValueError:
        raise PayhookError(f"--tenant: expected a UUID, got {tenant_id!r}") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise PayhookError(f"--limit: expected 1 to {MAX_LIMIT}, got {limit}")
    params = {"tenant_id": tenant_id, "event_id": event_id, "limit": limit}
    with tenant_transaction(conn, tenant_id):
        return fetch_all(conn, "list_operator_actions", params)
