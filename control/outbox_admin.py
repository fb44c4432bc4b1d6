"""Operator commands for the outbox: `payhook outbox list|retry|retry-dead`.

`list` prints one JSON object per row, newest first. `retry ID` makes one dead
row, or one pending row no worker holds, due now with a fresh attempt count;
`retry-dead` does that for every dead row. Both wake the workers.
"""

from __future__ import annotations

import argparse
import json
import uuid
from datetime import datetime
from typing import Any

import psycopg

from control import audit
from payhook.db import Row, connect, execute, fetch_all, fetch_one, tenant_of, tenant_transaction
from payhook.errors import NotFound, PayhookError
from payhook.settings import Settings

#: Most rows `list` prints at once.
MAX_LIST_LIMIT = 10_000


class NotRetryable(PayhookError):
    """The outbox row is delivered or held by a worker right now."""


def run(args: argparse.Namespace, settings: Settings) -> int:
    with connect(settings, "outbox-admin") as conn:
        if args.action == "list":
            for row in list_rows(conn, args.state, args.limit):
                print(json.dumps(row, default=_json_value))
        elif args.action == "retry":
            # The console's code path too; imported here, as actions imports this module.
            from control.actions import redeliver_outbox

            row = redeliver_outbox(conn, args.id)
            print(json.dumps({"id": row["id"], "tenant_id": row["tenant_id"], "retried": True}))
        elif args.action == "retry-dead":
            retried = retry_dead(conn)
            audit.record(conn, "outbox_retry_dead", "outbox", "*", result={"retried": retried})
            print(json.dumps({"retried": retried}))
        else:
            raise PayhookError(f"unknown outbox action {args.action!r}")
    return 0


def list_rows(conn: psycopg.Connection[Row], state: str | None, limit: int) -> list[Row]:
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise PayhookError(f"--limit: expected 1 to {MAX_LIST_LIMIT}, got {limit}")
    return fetch_all(conn, "list_outbox_rows", {"state": state, "limit": limit})


def retry_row(conn: psycopg.Connection[Row], row_id: str) -> Row:
    """Make one row due now; `NotFound` or `NotRetryable` explain a refusal."""
    params = {"id": _uuid(row_id)}
    tenant_id = tenant_of(conn, "payment_outbox", params["id"])
    if tenant_id is None:
        raise NotFound(f"no outbox row {row_id}")
    with tenant_transaction(conn, tenant_id):
        row = fetch_one(conn, "retry_outbox_row", params)
        if row is not None:
            execute(conn, "notify_outbox")
            return {"id": str(row["id"]), "tenant_id": str(row["tenant_id"])}
        current = fetch_one(conn, "get_outbox_row", params)
    if current is None:
        raise NotFound(f"no outbox row {row_id}")
    if current["state"] == "delivered":
        raise NotRetryable(f"outbox row {row_id} is already delivered")
    raise NotRetryable(f"outbox row {row_id} is being delivered by a worker right now")


def retry_dead(conn: psycopg.Connection[Row]) -> int:
    """Make every dead row due now; how many."""
    with conn.transaction():
        row = fetch_one(conn, "retry_dead_outbox_rows")
        count = 0 if row is None else int(row["retried"])
        if count:
            execute(conn, "notify_outbox")
    return count


def _uuid(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise PayhookError(f"expected an outbox row id (a UUID), got {value!r}") from None


def _json_value(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)
