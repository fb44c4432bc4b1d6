"""The operator actions that change payhook's state, one function each,
shared by the commands and the console: whichever an operator uses, the same
code runs and the same audit row is written (`control.audit`).

    replay_exception   re-apply an exception's event (or, dry, say what it would do)
    resolve_exception  close an exception without applying it; a note is required
    redeliver_outbox   make one dead or stuck outbox row due now

Each takes an `Operator`: who acts, and from where (`cli` or `dashboard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from control import audit
from control.outbox_admin import retry_row
from payhook.db import Row
from payhook.errors import PayhookError


@dataclass(frozen=True)
class Operator:
    """Who performs an action, and through what."""

    #: None: the command's actor (`audit.command_actor`).
    actor: str | None = None
    source: str = "cli"


#: The operator of a command line.
COMMAND = Operator()


#: Longest note an operator may give (the audit trail keeps it whole).
MAX_NOTE = 2000


class NoteRequired(PayhookError):
    """Closing an exception by hand needs the reason, for the audit trail."""


def replay_exception(
    conn: psycopg.Connection[Row],
    exception_id: int,
    *,
    tenant_id: str | None = None,
    dry_run: bool = False,
    by: Operator = COMMAND,
) -> Any:
    """Replay an exception's event through the consumer's own function
    (`consumer.replay`); a dry run takes the same locks and decisions and
    writes nothing but its audit row. Returns the `Replay`."""
    # The consumer's transaction, imported where an action runs, so the
    # shared kernel never depends on a component.
    from consumer.replay import replay_exception as replay

    result = replay(conn, exception_id, tenant_id=tenant_id, dry_run=dry_run)
    audit.record(
        conn,
        "exception_dry_run" if dry_run else "exception_replay",
        "exception",
        str(exception_id),
        tenant_id=result.tenant_id,
        event_id=result.event_id,
        result=result.to_json(),
        actor=by.actor,
        source=by.source,
    )
    return result


def resolve_exception(
    conn: psycopg.Connection[Row],
    exception_id: int,
    *,
    note: str,
    tenant_id: str | None = None,
    by: Operator = COMMAND,
) -> bool:
    """Close an exception by hand; whether this call closed it (False: it
    was closed already). `NoteRequired` without a reason."""
    from consumer.replay import resolve_by_hand

    if not note.strip():
        raise NoteRequired("closing an exception by hand needs a note saying why")
    if len(note) > MAX_NOTE:
        raise NoteRequired(f"a note is at most {MAX_NOTE} characters, this one {len(note)}")
    closed = resolve_by_hand(conn, exception_id, tenant_id=tenant_id)
    owner, event_id = audit.event_of(conn, "exception", str(exception_id))
    audit.record(
        conn,
        "exception_resolve",
        "exception",
        str(exception_id),
        tenant_id=owner,
        event_id=event_id,
        note=note,
        result={"changed": closed},
        actor=by.actor,
        source=by.source,
    )
    return closed


def redeliver_outbox(conn: psycopg.Connection[Row], row_id: str, *, by: Operator = COMMAND) -> Row:
    """Make one dead outbox row, or one pending row no worker holds, due now
    with a fresh attempt count, and wake the workers. `NotFound` or
    `NotRetryable` explain a refusal."""
    row = retry_row(conn, row_id)
    tenant_id, event_id = audit.event_of(conn, "outbox", str(row["id"]))
    audit.record(
        conn,
        "outbox_retry",
        "outbox",
        str(row["id"]),
        tenant_id=tenant_id,
        event_id=event_id,
        actor=by.actor,
        source=by.source,
    )
    return row
