"""The operators' console: payhook's own state, in the dashboard, one login.

    /console/exceptions   open or resolved, by kind, tenant, gateway and age
    /console/anomalies    digest conflicts, forged or unverifiable jobs, quarantined jobs
    /console/outbox       dead and overdue rows; redeliver one
    /console/orders       search by merchant reference or gateway order id
    /console/reconcile    reconciliation runs: window, found, queued, errors
    /console/trace        one event: receipt, order, transition, outbox, operators' actions

Lists read across tenants through the owner's narrow functions (migration
0019), a page at a time on an index, newest first; "older" follows a keyset
cursor (the last row shown), never an offset. Actions are POSTs from these
pages with the dashboard's anti-forgery token, and run `control.actions`,
the code the commands run, so each writes its audit row. Pages are rendered
on the server (`control/templates/console/`), with no script; no payload,
stored event or secret is ever read for them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
import structlog
from flask import Blueprint, redirect, render_template, request, url_for
from redis import Redis
from redis.exceptions import RedisError
from werkzeug.wrappers import Response

from control import actions, audit
from control.alerts import AlertSettings
from control.operations import trace_event
from control.outbox_admin import NotRetryable
from payhook import quarantine
from payhook.db import Row, connect, error_summary, fetch_all, tenant_transaction
from payhook.errors import NotFound, PayhookError
from payhook.gateways import GATEWAYS
from payhook.outcomes import ANOMALY_KINDS, EXCEPTION_KINDS
from payhook.settings import Settings, parse_duration

log = structlog.get_logger(__name__)

#: Rows on one page unless `?limit=` says otherwise, and the most it may say.
PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
#: The states an exceptions page lists.
EXCEPTION_STATES = ("open", "resolved", "all")
#: The outbox views: rows given up on, and rows undelivered past the SLA.
OUTBOX_VIEWS = ("dead", "overdue")
#: Longest search text of the orders page (a reference is at most 500).
MAX_REFERENCE = 500
#: Events listed under each order found.
ORDER_EVENTS = 20
#: The console's pages, in the order of its navigation bar.
PAGES = (
    ("console.exceptions", "Exceptions"),
    ("console.anomalies", "Anomalies"),
    ("console.outbox", "Outbox"),
    ("console.orders", "Orders"),
    ("console.reconcile", "Reconciliation"),
)
#: The console's views that change state: POST only, with the anti-forgery token.
ACTIONS = frozenset({"console.dry_run", "console.replay", "console.resolve", "console.redeliver"})


class BadRequest(PayhookError):
    """A filter, cursor or form field the console cannot take; shown as a 400."""


@dataclass(frozen=True)
class Cursor:
    """Where the next page starts: after this row (its time and id)."""

    at: datetime
    id: str

    def __str__(self) -> str:
        return f"{self.at.isoformat()}|{self.id}"

    @classmethod
    def parse(cls, text: str | None, id_kind: Callable[[str], object]) -> Cursor | None:
        if not text:
            return None
        at, sep, row_id = text.partition("|")
        try:
            moment = datetime.fromisoformat(at)
            id_kind(row_id)
        except ValueError:
            raise BadRequest(f"before: not a cursor of this page: {text!r}") from None
        if not sep or moment.tzinfo is None:
            raise BadRequest(f"before: not a cursor of this page: {text!r}")
        return cls(moment, row_id)

    @classmethod
    def after(cls, rows: list[Row], time_column: str, limit: int) -> Cursor | None:
        """The cursor of the page after `rows`; None when they were the last."""
        if len(rows) < limit:
            return None
        last = rows[-1]
        return cls(last[time_column], str(last["id"]))

    def params(self) -> dict[str, Any]:
        return {"before_at": self.at, "before_id": self.id}


NO_CURSOR = {"before_at": None, "before_id": None}


def create_blueprint(settings: Settings, redis: Redis, user: str) -> Blueprint:
    """The console's views, acting as the dashboard's login `user`."""
    console = Blueprint("console", __name__, url_prefix="/console", template_folder="templates")
    operator = actions.Operator(actor=user, source="dashboard")
    sla = AlertSettings.from_settings(settings).outbox_sla

    @contextmanager
    def database() -> Iterator[psycopg.Connection[Row]]:
        with connect(settings, "console") as conn:
            yield conn

    def page(template: str, **values: Any) -> str:
        return render_template(f"console/{template}", pages=PAGES, **values)

    console.add_app_template_filter(_utc, "utc")

    @console.errorhandler(BadRequest)
    def bad_request(exc: BadRequest) -> tuple[str, int]:
        return page("message.html", title="Not understood", message=str(exc)), 400

    @console.errorhandler(psycopg.OperationalError)
    def database_away(exc: psycopg.OperationalError) -> tuple[str, int]:
        log.warning("console_database_unavailable", error=error_summary(exc))
        message = "PostgreSQL does not answer; the queues' pages still work."
        return page("message.html", title="PostgreSQL unavailable", message=message), 503

    @console.get("/")
    def index() -> Response:
        return redirect(url_for("console.exceptions"))

    @console.get("/exceptions")
    def exceptions() -> str:
        args = request.args
        state = _choice(args, "state", EXCEPTION_STATES, "open")
        kind = _choice(args, "kind", tuple(sorted(EXCEPTION_KINDS)), None)
        gateway = _choice(args, "gateway", tuple(sorted(GATEWAYS)), None)
        tenant = _uuid(args.get("tenant"), "tenant")
        newer = _duration(args.get("newer_than"), "newer_than")
        older = _duration(args.get("older_than"), "older_than")
        limit = _limit(args.get("limit"))
        cursor = Cursor.parse(args.get("before"), int)
        params = {
            "state": state,
            "kind": kind,
            "tenant_id": tenant,
            "gateway": gateway,
            "newer_than": newer,
            "older_than": older,
            "limit": limit,
        } | (cursor.params() if cursor else NO_CURSOR)
        with database() as conn:
            rows = fetch_all(conn, "console_exceptions", params)
        return page(
            "exceptions.html",
            rows=rows,
            filters={k: v for k, v in args.items() if k not in ("before",) and v},
            kinds=sorted(EXCEPTION_KINDS),
            gateways=sorted(GATEWAYS),
            states=EXCEPTION_STATES,
            state=state,
            next=Cursor.after(rows, "created_at", limit),
        )

    @console.get("/anomalies")
    def anomalies() -> str:
        args = request.args
        kind = _choice(args, "kind", tuple(sorted(ANOMALY_KINDS)), None)
        limit = _limit(args.get("limit"))
        cursor = Cursor.parse(args.get("before"), int)
        params = {"kind": kind, "limit": limit} | (cursor.params() if cursor else NO_CURSOR)
        with database() as conn:
            rows = fetch_all(conn, "console_anomalies", params)
        try:
            jobs = [entry.to_json() for entry in quarantine.list_jobs(redis, settings.queue)]
            jobs_error = None
        except RedisError as exc:
            jobs, jobs_error = [], f"Redis does not answer: {exc.__class__.__name__}"
        return page(
            "anomalies.html",
            rows=rows,
            kinds=sorted(ANOMALY_KINDS),
            descriptions=ANOMALY_KINDS,
            filters={k: v for k, v in args.items() if k != "before" and v},
            next=Cursor.after(rows, "detected_at", limit),
            quarantined=jobs,
            quarantine_error=jobs_error,
        )

    @console.get("/outbox")
    def outbox() -> str:
        args = request.args
        view = _choice(args, "view", OUTBOX_VIEWS, "dead")
        limit = _limit(args.get("limit"))
        cursor = Cursor.parse(args.get("before"), uuid.UUID)
        params = {"view": view, "sla": sla, "limit": limit}
        with database() as conn:
            rows = fetch_all(conn, "console_outbox", params | _cursor(cursor))
        return page(
            "outbox.html",
            rows=rows,
            view=view,
            views=OUTBOX_VIEWS,
            sla=sla,
            filters={k: v for k, v in args.items() if k != "before" and v},
            next=Cursor.after(rows, "created_at", limit),
        )

    @console.get("/orders")
    def orders() -> str:
        reference = request.args.get("q", "").strip()
        if len(reference) > MAX_REFERENCE:
            raise BadRequest(f"q: a reference is at most {MAX_REFERENCE} characters")
        found: list[dict[str, Any]] = []
        if reference:
            with database() as conn:
                for order in fetch_all(
                    conn, "console_orders", {"reference": reference, "limit": PAGE_SIZE}
                ):
                    key = {"tenant_id": order["tenant_id"], "order_id": order["id"]}
                    with tenant_transaction(conn, order["tenant_id"]):
                        events = fetch_all(
                            conn, "console_order_events", key | {"limit": ORDER_EVENTS}
                        )
                    found.append(order | {"events": events})
        return page("orders.html", reference=reference, orders=found)

    @console.get("/reconcile")
    def reconcile() -> str:
        limit = _limit(request.args.get("limit"))
        cursor = Cursor.parse(request.args.get("before"), uuid.UUID)
        with database() as conn:
            rows = fetch_all(conn, "console_reconcile_runs", {"limit": limit} | _cursor(cursor))
        return page("reconcile.html", rows=rows, next=Cursor.after(rows, "started_at", limit))

    @console.get("/trace")
    def trace() -> str:
        tenant = _uuid(request.args.get("tenant"), "tenant")
        event_id = request.args.get("event", "")
        if tenant is None or not event_id:
            raise BadRequest("a trace needs a tenant (a UUID) and an event id")
        with database() as conn:
            found = trace_event(conn, tenant, event_id)
        return page("trace.html", trace=found, asked=event_id)

    @console.post("/exceptions/<int:exception_id>/dry-run")
    def dry_run(exception_id: int) -> tuple[str, int]:
        return replayed(exception_id, dry_run=True)

    @console.post("/exceptions/<int:exception_id>/replay")
    def replay(exception_id: int) -> tuple[str, int]:
        return replayed(exception_id, dry_run=False)

    def replayed(exception_id: int, dry_run: bool) -> tuple[str, int]:
        try:
            with database() as conn:
                result = actions.replay_exception(conn, exception_id, dry_run=dry_run, by=operator)
        except (NotFound, PayhookError) as exc:
            return refused(exc)
        return page("replayed.html", replay=result), 200

    @console.post("/exceptions/<int:exception_id>/resolve")
    def resolve(exception_id: int) -> tuple[str, int]:
        note = request.form.get("note", "")
        try:
            with database() as conn:
                changed = actions.resolve_exception(conn, exception_id, note=note, by=operator)
                trace_of = _trace_link(conn, "exception", str(exception_id))
        except (NotFound, PayhookError) as exc:
            return refused(exc)
        message = (
            f"Exception {exception_id} is closed, and the note kept in the audit trail."
            if changed
            else f"Exception {exception_id} was already closed; nothing changed."
        )
        return page("message.html", title="Resolved", message=message, trace=trace_of), 200

    @console.post("/outbox/<row_id>/redeliver")
    def redeliver(row_id: str) -> tuple[str, int]:
        try:
            with database() as conn:
                row = actions.redeliver_outbox(conn, row_id, by=operator)
                trace_of = _trace_link(conn, "outbox", str(row["id"]))
        except (NotFound, NotRetryable, PayhookError) as exc:
            return refused(exc)
        message = f"Outbox row {row['id']} is due now; the outbox workers were woken."
        return page("message.html", title="Redelivering", message=message, trace=trace_of), 200

    def refused(exc: PayhookError) -> tuple[str, int]:
        status = 404 if isinstance(exc, NotFound) else 409
        if isinstance(exc, actions.NoteRequired):
            status = 400
        return page("message.html", title="Not done", message=str(exc)), status

    return console


def _trace_link(conn: psycopg.Connection[Row], kind: str, object_id: str) -> dict[str, str] | None:
    tenant_id, event_id = audit.event_of(conn, kind, object_id)
    if tenant_id is None or event_id is None:
        return None
    return {"tenant": tenant_id, "event": event_id}


def _utc(value: datetime) -> str:
    """A time as the pages show it: to the second, in UTC."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _cursor(cursor: Cursor | None) -> dict[str, Any]:
    return cursor.params() if cursor else NO_CURSOR


def _choice(args: Any, name: str, allowed: tuple[str, ...], default: str | None) -> str | None:
    value = args.get(name) or default
    if value is not None and value not in allowed:
        raise BadRequest(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


def _uuid(value: str | None, name: str) -> str | None:
    if not value:
        return None
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise BadRequest(f"{name}: expected a UUID, got {value!r}") from None


def _duration(value: str | None, name: str) -> float | None:
    if not value:
        return None
    try:
        return parse_duration(name, value)
    except PayhookError as exc:
        raise BadRequest(str(exc)) from None


def _limit(value: str | None) -> int:
    if not value:
        return PAGE_SIZE
    if not (value.isascii() and value.isdecimal() and len(value) <= 4) or not (
        1 <= int(value) <= MAX_PAGE_SIZE
    ):
        raise BadRequest(f"limit: expected 1 to {MAX_PAGE_SIZE}, got {value!r}")
    return int(value)
