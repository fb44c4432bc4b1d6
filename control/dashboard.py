"""`payhook dashboard`: rq-dashboard on the events queue, made safe for JSON jobs.

rq-dashboard 0.9 as shipped does not fit payhook, so this module wraps it:

- it reads jobs with the pickle serializer in several views, and its requeue
  buttons call RQ without a serializer: here every job is read as JSON, and
  requeue goes through `control.operations.requeue_dead_letter` (JSON, events
  queue only, `apply_event` jobs only, a fresh retry budget);
- its command binds 0.0.0.0: here the default is 127.0.0.1, and any other
  address needs `PAYHOOK_DASHBOARD_PASSWORD`;
- it has no authentication: here every page needs HTTP basic auth (without a
  password on loopback, one is generated for the run and printed once);
- "requeue all" answers a plain GET and nothing checks where a request comes
  from: here a state change must be a POST from the dashboard's own pages,
  carrying the `_csrf_token` cookie's value in `X-CSRFToken` (its own
  JavaScript already sends it), and no browser may frame the pages;
- its Compact, Empty and Delete actions drop job ids, or move them one at a
  time where a dashboard stopped midway strands them: here each is refused,
  whatever the method or token (403, logged; `REFUSED` says why), and its
  buttons are hidden; requeueing is the one action that moves jobs, one
  atomic move per job (`control.operations`);
- its job lists stop at the first job RQ cannot read (a forged or damaged
  hash or result): here such a job is listed as unreadable beside the others;
- its pages print job ids and worker fields as HTML, unescaped: here an id RQ
  would not give is listed as `(unreadable)` and worker fields are escaped;
- its navbar prints the Redis URL, hiding only a `user:password@` it
  recognises: here it shows scheme, host, port and database only, and every
  view uses payhook's own Redis connection.

| variable | default | meaning |
|---|---|---|
| `PAYHOOK_DASHBOARD_HOST` | 127.0.0.1 | address to listen on |
| `PAYHOOK_DASHBOARD_PORT` | 9181 | port to listen on |
| `PAYHOOK_DASHBOARD_USER` | payhook | basic-auth user |
| `PAYHOOK_DASHBOARD_PASSWORD` | (none) | basic-auth password; required off loopback |

Under the same login, `/console/` is payhook's own state (`control.console`).
`GET /healthz` answers without credentials; `GET /metrics` (with them) exports
the alert signals (`control.alerts`) for Prometheus.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape
from types import FrameType
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psycopg
import structlog
from flask import Flask, Response, current_app, g, jsonify, render_template, request, url_for
from jinja2 import ChoiceLoader, DictLoader, PrefixLoader
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from redis import Redis
from rq import Queue, Worker
from rq.job import JOB_ID_PATTERN, Job
from rq.registry import (
    BaseRegistry,
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.serializers import JSONSerializer
from rq.utils import utcparse
from rq.worker import BaseWorker
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.serving import make_server

from control import console
from control.alerts import AlertCollector, AlertSettings, AlertsUnavailable, Signal, read_signals
from control.flow_metrics import FlowCollector
from control.operations import (
    NotRequeueable,
    fetch_job,
    latest_error,
    record_requeues,
    requeue_all_dead_letters,
    requeue_dead_letter,
)
from payhook import quarantine
from payhook.compat import (
    give_rq_dashboard_connection,
    replace_rq_dashboard_before_request,
    replace_rq_dashboard_views,
    use_rq_dashboard_serializer,
)
from payhook.db import connect, error_summary
from payhook.errors import NotFound, SettingsError
from payhook.logs import configure_logging
from payhook.outcomes import check_outcomes
from payhook.queue import redis_connection
from payhook.settings import Secret, Settings, positive_int

log = structlog.get_logger(__name__)

#: Address the dashboard listens on unless told otherwise.
DEFAULT_HOST = "127.0.0.1"
#: Port the dashboard listens on unless told otherwise (rq-dashboard's).
DEFAULT_PORT = 9181
#: Basic-auth user unless `PAYHOOK_DASHBOARD_USER` says otherwise.
DEFAULT_USER = "payhook"
#: Cookie holding the anti-forgery token rq-dashboard's JavaScript echoes back.
CSRF_COOKIE = "_csrf_token"
#: Header the dashboard's JavaScript puts that token in.
CSRF_HEADER = "X-CSRFToken"
#: Form field the console's pages, which run no script, put that token in.
CSRF_FIELD = "_csrf_token"
#: Views that change state: POST only, and only from the dashboard's own pages.
STATE_CHANGING = (
    frozenset({"rq_dashboard.requeue_job_view", "rq_dashboard.requeue_all"}) | console.ACTIONS
)
#: rq-dashboard's actions that drop job ids or move them one at a time, and why
#: each is refused: whatever the method or token, they never run here. A
#: dead-letter job is the only copy of an event the gateway acknowledged and
#: will not send again; the consumer records what it cannot apply, so such an
#: event is requeued, never deleted.
REFUSED = {
    "rq_dashboard.compact_queue": (
        "compacting renames the queue, then moves its job ids back one at a time: "
        "a dashboard stopped midway strands them outside the queue"
    ),
    "rq_dashboard.empty_queue": (
        "emptying deletes every job listed, each one an acknowledged event "
        "the gateway will not send again"
    ),
    "rq_dashboard.delete_job_view": (
        "deleting a job deletes the only copy of an acknowledged event; "
        "requeue it instead, and the consumer records what it cannot apply"
    ),
}
#: rq-dashboard's jobs page as shipped, with the buttons of the refused actions
#: hidden (Empty and Delete are hidden by `RQ_DASHBOARD_DISABLE_DELETE` too).
JOBS_PAGE = """{% extends "shipped/rq_dashboard/jobs.html" %}
{% block content %}
<style>
#compact-btn, #empty-btn, [data-role=delete-job-btn] { display: none !important; }
</style>
{{ super() }}
{% endblock %}
"""
#: rq-dashboard's navigation bar, under a link to payhook's console.
NAVBAR = """<div style="padding: .4rem 1rem; background: #1b1f24;">
<a href="{{ url_for('console.exceptions') }}" style="color: #fff;">payhook console:
exceptions, anomalies, outbox, orders, reconciliation</a></div>
{% include "shipped/rq_dashboard/navbar.html" %}
"""
#: Paths answered without credentials.
PUBLIC_PATHS = frozenset({"/healthz"})
#: Milliseconds between two refreshes of a dashboard page.
POLL_INTERVAL_MS = 2500
#: Most jobs one page of a job list shows.
MAX_PER_PAGE = 1000
#: Highest page number of a job list: offsets stay far inside what Redis takes.
MAX_PAGE = 10**9
#: Shown in place of a job id RQ would not give (which the dashboard's pages
#: would print as HTML): no such job can exist, and it needs no escaping.
UNREADABLE_ID = "(unreadable)"
#: Shown as an unreadable job's creation time when its hash has none
#: readable: the pages print it as an invalid date, not as "just now".
UNKNOWN_TIME = "unknown"
#: The job registries of a queue, by the name the dashboard's URLs give them.
REGISTRIES: dict[str, type[BaseRegistry]] = {
    "failed": FailedJobRegistry,
    "started": StartedJobRegistry,
    "finished": FinishedJobRegistry,
    "deferred": DeferredJobRegistry,
    "scheduled": ScheduledJobRegistry,
    "canceled": CanceledJobRegistry,
}


@dataclass(frozen=True)
class DashboardSettings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    user: str = DEFAULT_USER
    password: Secret | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> DashboardSettings:
        extra = settings.extra
        port = DEFAULT_PORT
        if "PAYHOOK_DASHBOARD_PORT" in extra:
            port = positive_int("PAYHOOK_DASHBOARD_PORT", extra["PAYHOOK_DASHBOARD_PORT"])
            if port > 65535:
                raise SettingsError(f"PAYHOOK_DASHBOARD_PORT: expected 1 to 65535, got {port}")
        user = extra.get("PAYHOOK_DASHBOARD_USER") or DEFAULT_USER
        if ":" in user:
            raise SettingsError("PAYHOOK_DASHBOARD_USER: a basic-auth user cannot contain ':'")
        password = extra.get("PAYHOOK_DASHBOARD_PASSWORD") or None
        return cls(
            host=extra.get("PAYHOOK_DASHBOARD_HOST") or DEFAULT_HOST,
            port=port,
            user=user,
            password=Secret(password) if password else None,
        )

    def bound(self, host: str | None, port: int | None) -> DashboardSettings:
        """This config listening where the command line says; refused without a password
        off loopback."""
        config = DashboardSettings(
            host=host or self.host,
            port=self.port if port is None else port,
            user=self.user,
            password=self.password,
        )
        if not is_loopback(config.host) and not config.password:
            raise SettingsError(
                f"PAYHOOK_DASHBOARD_PASSWORD: required to listen on {config.host}; "
                "without it the dashboard only listens on 127.0.0.1"
            )
        return config


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def create_app(settings: Settings, user: str, password: str) -> Flask:
    """The dashboard's WSGI app. Building it connects to nothing."""
    import rq_dashboard.default_settings
    import rq_dashboard.web as web

    # Every job this app reads is read as JSON, never unpickled.
    use_rq_dashboard_serializer(JSONSerializer)
    # The pages ask for `/static/...` from both the app and the blueprint: serve
    # rq-dashboard's files from both, as its own command does.
    app = Flask(__name__, static_folder=web.blueprint.static_folder)
    # Pages named here replace rq-dashboard's, which stay reachable as
    # "shipped/<name>" for these to extend.
    app.jinja_loader = ChoiceLoader(
        [
            DictLoader({"rq_dashboard/jobs.html": JOBS_PAGE, "rq_dashboard/navbar.html": NAVBAR}),
            PrefixLoader({"shipped": web.blueprint.jinja_loader}),
        ]
    )
    app.config.from_object(rq_dashboard.default_settings)
    app.config.update(
        # Shown in every page's navbar, and nothing else: the views use `redis`.
        RQ_DASHBOARD_REDIS_URL=display_url(settings.redis_url),
        RQ_DASHBOARD_DISABLE_DELETE=True,
        RQ_DASHBOARD_POLL_INTERVAL=POLL_INTERVAL_MS,
        RQ_DASHBOARD_SHOW_FULL_ARGS=False,
    )
    app.register_blueprint(web.blueprint)
    redis = redis_connection(settings, timeout=10)
    # rq-dashboard's views would connect anew on each request from the URL
    # above: they get payhook's connection, and the URL no credentials.
    give_rq_dashboard_connection(app, redis)
    alert_config = AlertSettings.from_settings(settings)
    # One read of the signals at a time: a scrape that waits for the one in
    # progress past the read timeout reports them unreadable, so scrapes
    # cannot pile up connections while PostgreSQL is slow or a table locked.
    reading = threading.Lock()

    def read_alerts() -> list[Signal]:
        if not reading.acquire(timeout=alert_config.timeout):
            raise AlertsUnavailable("the previous read of the signals has not finished")
        try:
            with connect(settings, "dashboard") as conn:
                return read_signals(conn, redis, settings, alert_config)
        finally:
            reading.release()

    metrics = CollectorRegistry(auto_describe=False)
    metrics.register(AlertCollector(read_alerts))
    metrics.register(FlowCollector(redis, settings))

    @app.before_request
    def guard() -> Response | None:
        if request.path in PUBLIC_PATHS:
            return None
        auth = request.authorization
        if auth is None or not (
            _same(auth.username or "", user) & _same(auth.password or "", password)
        ):
            return Response(
                "credentials required\n",
                401,
                {"WWW-Authenticate": 'Basic realm="payhook dashboard", charset="UTF-8"'},
            )
        endpoint = _requested_endpoint()
        if endpoint in REFUSED:
            return refuse(endpoint)
        if request.endpoint in STATE_CHANGING:
            refusal = _refuse_forgery()
            if refusal is not None:
                log.warning(
                    "dashboard_request_refused",
                    endpoint=request.endpoint,
                    method=request.method,
                    reason=refusal,
                )
                status = 405 if refusal == "method" else 403
                return Response(f"refused: {refusal}\n", status, {"Allow": "POST"})
        return None

    @app.context_processor
    def forms() -> dict[str, Any]:
        return {"csrf_token": csrf_token}

    @app.after_request
    def harden(response: Response) -> Response:
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Content-Security-Policy"] = "frame-ancestors 'none'"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        if request.path not in PUBLIC_PATHS and not request.cookies.get(CSRF_COOKIE):
            response.set_cookie(
                CSRF_COOKIE,
                csrf_token(),
                samesite="Strict",
                secure=request.is_secure,
                httponly=False,  # the dashboard's JavaScript reads it
            )
        return response

    def refuse(endpoint: str) -> Response:
        log.warning(
            "dashboard_action_refused",
            endpoint=endpoint,
            method=request.method,
            user=user,
        )
        response, status = _answer(
            "REFUSED",
            403,
            action=endpoint.removeprefix("rq_dashboard."),
            reason=f"not offered by payhook's dashboard: {REFUSED[endpoint]}",
        )
        response.status_code = status
        return response

    def refused_view(endpoint: str) -> Callable[..., Response]:
        # Never reached past `guard`; here so that rq-dashboard's view cannot
        # run even if the guard stopped seeing it.
        def view(**_: Any) -> Response:
            return refuse(endpoint)

        return view

    def use_one_instance() -> Response | None:
        # In place of rq-dashboard's, which connects to Redis for each request.
        if (request.view_args or {}).get("instance_number", 0) != 0:
            return Response("no such instance\n", 404)
        return None

    def audit_requeues(job_ids: list[str]) -> None:
        try:
            record_requeues(settings, job_ids, actor=user, source="dashboard")
        except psycopg.Error as exc:  # requeued all the same: said in the log
            log.error("dashboard_audit_failed", error=error_summary(exc), jobs=len(job_ids))

    def requeue_job_view(job_id: str) -> tuple[Response, int]:
        try:
            requeue_dead_letter(redis, settings, job_id)
        except NotFound as exc:
            return _answer("ERROR", 404, job_id=job_id, reason=str(exc))
        except NotRequeueable as exc:
            return _answer("ERROR", 409, job_id=job_id, reason=str(exc))
        log.info("dashboard_job_requeued", job_id=job_id, user=user)
        audit_requeues([job_id])
        return _answer("OK", 200, job_id=job_id)

    def requeue_all(queue_name: str) -> tuple[Response, int]:
        if queue_name != settings.queue:
            return _answer("ERROR", 409, reason=f"only {settings.queue!r} is requeued here")
        requeued, refused = requeue_all_dead_letters(redis, settings)
        log.info("dashboard_jobs_requeued", requeued=len(requeued), refused=len(refused))
        audit_requeues(requeued)
        return _answer("OK", 200, count=len(requeued), refused=refused)

    def job_view(instance_number: int, job_id: str) -> Response:
        if not Job.exists(job_id, connection=redis):
            return Response("no such job\n", 404)
        page = render_template(
            "rq_dashboard/job.html",
            current_instance=instance_number,
            instance_list=web.escape_format_instance_list(
                current_app.config.get("RQ_DASHBOARD_REDIS_URL")
            ),
            id=job_id,
            rq_url_prefix=url_for("rq_dashboard.queues_overview"),
            rq_dashboard_version=web.rq_dashboard_version,
            rq_version=web.rq_version,
            deprecation_options_usage=False,
            enable_delete=False,
        )
        return Response(page, headers={"Cache-Control": "no-store"})

    def list_jobs(
        instance_number: int,
        queue_name: str,
        registry_name: str,
        per_page: str,
        order: str,
        page: str,
    ) -> tuple[Response, int]:
        size, number = _count(per_page, MAX_PER_PAGE), _count(page, MAX_PAGE)
        if size is None or number is None:
            return _answer("ERROR", 404, reason="no such page")
        if registry_name != "queued" and registry_name not in REGISTRIES:
            return _answer("ERROR", 404, reason=f"no registry {registry_name!r}")
        queue = Queue(queue_name, connection=redis, serializer=JSONSerializer)
        ids, total = _page_of_ids(queue, registry_name, (number - 1) * size, size, order == "dsc")
        rows = [row for row in (_job_row(redis, job_id) for job_id in ids) if row is not None]
        pages = -(-total // size)

        def link(to: int) -> dict[str, str]:
            return {
                "url": url_for(
                    "rq_dashboard.jobs_overview",
                    instance_number=instance_number,
                    queue_name=queue_name,
                    registry_name=registry_name,
                    per_page=size,
                    order=order,
                    page=to,
                )
            }

        pagination: dict[str, Any] = {
            "current_page": number,
            "num_pages": pages,
            "pages_in_window": [
                {"number": n} | link(n) for n in web.pagination_window(total, number, size)
            ],
            "first_page": link(1),
            "last_page": link(max(1, pages)),
        }
        if number > 1:
            pagination["prev_page"] = link(number - 1)
        if number < pages:
            pagination["next_page"] = link(number + 1)
        return _answer_data(
            name=queue_name, registry_name=registry_name, jobs=rows, pagination=pagination
        )

    def list_workers(instance_number: int) -> tuple[Response, int]:
        # The workers page prints these as HTML, unescaped, but for the
        # current job's description: whoever writes Redis writes them.
        workers = [
            {
                "name": escape(worker.name),
                "pid": worker.pid,
                "queues": [escape(q.name) for q in worker.queues],
                "state": escape(str(worker.get_state())),
                "current_job": _current_job(worker),
                "last_heartbeat": worker.last_heartbeat,
                "birth_date": worker.birth_date,
                "successful_job_count": worker.successful_job_count,
                "failed_job_count": worker.failed_job_count,
                "total_working_time": worker.total_working_time,
                "version": escape(str(getattr(worker, "version", ""))),
                "python_version": escape(str(getattr(worker, "python_version", ""))),
            }
            for worker in Worker.all(connection=redis, serializer=JSONSerializer)
        ]
        workers.sort(key=lambda w: (w["state"], w["queues"], w["name"]))
        return jsonify(workers=workers), 200

    def job_info(instance_number: int, job_id: str) -> tuple[Response, int]:
        """The job page's data. rq-dashboard's page prints every field as
        HTML, so each is escaped here: a job hash written by anyone who can
        write to Redis must not put markup in an operator's page. A job RQ
        cannot read is shown as such, not answered with a 500."""
        if not JOB_ID_PATTERN.fullmatch(job_id):
            return _answer("ERROR", 404, reason="not a job id")
        try:
            job = fetch_job(redis, job_id)
        except NotFound:
            return _answer("ERROR", 404, reason="no such job")
        except NotRequeueable as exc:
            return _answer_data(**_job_page(job_id, description=f"unreadable job: {exc}"))
        return _answer_data(
            **_job_page(
                job.id,
                description=job.description,
                origin=job.origin,
                # The page offers a requeue for the status "failed".
                status=_readable(lambda: getattr(job.get_status(), "value", None)),
                result=_readable(job.return_value),
                exc_info=latest_error(job),
                metadata=_readable(lambda: json.dumps(job.get_meta(), default=repr)),
                created_at=_iso(job.created_at),
                enqueued_at=_iso(job.enqueued_at),
                started_at=_iso(job.started_at),
                ended_at=_iso(job.ended_at),
            )
        )

    # rq-dashboard's own views for these read jobs with pickle, requeue
    # without the serializer, or fail on the first job they cannot read; the
    # URLs stay, the functions are ours.
    views: dict[str, Callable[..., Any]] = {
        "rq_dashboard.requeue_job_view": requeue_job_view,
        "rq_dashboard.list_jobs": list_jobs,
        "rq_dashboard.requeue_all": requeue_all,
        "rq_dashboard.job_view": job_view,
        "rq_dashboard.job_info": job_info,
        "rq_dashboard.list_workers": list_workers,
    }
    views.update((endpoint, refused_view(endpoint)) for endpoint in REFUSED)
    app.register_blueprint(console.create_blueprint(settings, redis, user))
    replace_rq_dashboard_before_request(app, [use_one_instance])
    replace_rq_dashboard_views(app, views)

    @app.get("/healthz")
    def healthz() -> Response:
        return Response('{"status": "ok"}\n', mimetype="application/json")

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics), mimetype=CONTENT_TYPE_LATEST)

    @app.get("/quarantine")
    def quarantined() -> Response:
        """Jobs the consumers could not read: what `payhook quarantine list`
        prints, as a page (or JSON with `?format=json`). Reasons name a field,
        never its content; ids are escaped like everything else shown."""
        entries = [entry.to_json() for entry in quarantine.list_jobs(redis, settings.queue)]
        headers = {"Cache-Control": "no-store"}
        if request.args.get("format") == "json":
            return Response(
                json.dumps({"jobs": entries}), mimetype="application/json", headers=headers
            )
        return Response(
            _quarantine_page(settings.queue, entries), mimetype="text/html", headers=headers
        )

    return app


def _quarantine_page(queue: str, entries: list[dict[str, Any]]) -> str:
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{escape(str(entry[k]))}</td>"
            for k in ("job_id", "quarantined_at", "reason", "found_in")
        )
        + "</tr>"
        for entry in entries
    )
    empty = "" if entries else "<p>Nothing is quarantined.</p>"
    return (
        '<!doctype html><html><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>payhook: quarantined jobs</title></head><body>"
        f"<h1>Quarantined jobs of {escape(queue)}</h1>"
        "<p>Jobs in Redis the consumers could not read, set aside so that they go on. "
        "Inspect them with <code>payhook quarantine show JOB_ID</code>, then "
        "<code>payhook quarantine purge</code>.</p>"
        f"{empty}<table><thead><tr><th>job id</th><th>quarantined at</th><th>reason</th>"
        f"<th>found in</th></tr></thead><tbody>{rows}</tbody></table>"
        '<p><a href="./">back to the queues</a></p></body></html>'
    )


class _Stop(Exception):
    """Raised by the dashboard's signal handler to end `serve_forever`."""


def run(settings: Settings, host: str | None = None, port: int | None = None) -> int:
    """Serve the dashboard until SIGTERM or SIGINT."""
    configure_logging(settings.log_level)
    config = DashboardSettings.from_settings(settings).bound(host, port)
    check_schema(settings)
    password = str(config.password) if config.password else secrets.token_urlsafe(18)
    if config.password is None:
        # Loopback only (checked above); shown once, on the terminal, never logged.
        print(
            f"payhook dashboard: no PAYHOOK_DASHBOARD_PASSWORD, so for this run: "
            f"user {config.user}, password {password}",
            file=sys.stderr,
            flush=True,
        )
    app = create_app(settings, config.user, password)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = make_server(config.host, config.port, app, threaded=True)

    stopped_by: list[str] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        # Nothing but raising here: a handler that logged could land while
        # this thread held the log's lock, and wait for it forever.
        if not stopped_by:
            stopped_by.append(signal.Signals(signum).name)
            raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        log.info(
            "dashboard_started",
            url=f"http://{config.host}:{server.server_port}/",
            user=config.user,
            queue=settings.queue,
        )
        server.serve_forever(poll_interval=0.2)
    except _Stop:
        log.info("dashboard_stopping", signal=stopped_by[0])
    finally:
        server.server_close()
    log.info("dashboard_stopped")
    return 0


def check_schema(settings: Settings) -> None:
    """Refuse to start on a database whose lists of outcomes are not this
    release's (`OutcomesMismatch`). PostgreSQL not answering is no reason
    not to start: the dashboard's queues live in Redis, and an outage is when
    an operator needs them."""
    try:
        with connect(settings, "dashboard") as conn:
            check_outcomes(conn)
    except psycopg.OperationalError as exc:
        log.warning("outcomes_unchecked", error=error_summary(exc))


def display_url(url: str) -> str:
    """`url` as the dashboard shows it: scheme, host, port (or socket path) and
    database only.

    Credentials never show, whether in the userinfo (an unescaped '@' in the
    password included) or in the query string (`?password=`). An unescaped
    '/', '?' or '#' in the password ends the userinfo early, for redis-py as
    for anyone: the rest of the URL cannot be told from the password, so such
    a URL shows as its scheme alone.
    """
    parts = urlsplit(url)
    if "@" in parts.path + parts.query + parts.fragment:
        return f"{parts.scheme}://"
    db = parse_qs(parts.query).get("db", [""])[0]
    query = f"?db={db}" if db.isascii() and db.isdecimal() else ""
    if parts.scheme == "unix":
        return f"unix://{parts.path}{query}"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    number = parts.path.strip("/")
    path = parts.path if number.isascii() and number.isdecimal() else ""
    return f"{parts.scheme}://{host}{port}{path}{query}"


def _page_of_ids(
    queue: Queue, registry_name: str, offset: int, size: int, newest_first: bool
) -> tuple[list[str], int]:
    """One page of the job ids of `queue` or of one of its registries, and how many there are."""
    if registry_name == "queued":
        total = queue.count
        if not newest_first:
            return queue.get_job_ids(offset, size), total
        end = total - offset
        start = max(0, end - size)
        return list(reversed(queue.get_job_ids(start, max(0, end - start)))), total
    registry = REGISTRIES[registry_name](queue=queue)
    total = registry.get_job_count(cleanup=False)
    ids = registry.get_job_ids(offset, offset + size - 1, desc=newest_first, cleanup=False)
    return ids, total


def _job_row(redis: Redis, job_id: str) -> dict[str, Any] | None:
    """A job as the dashboard lists it; None if it is gone. A job RQ cannot
    read is listed as such, so that it hides no other.

    rq-dashboard's job list prints `id` (and the times, once its JavaScript has
    made them relative) as HTML, and escapes `description` and `exc_info`: an
    id RQ would not give is shown only in the description.
    """
    if not JOB_ID_PATTERN.fullmatch(job_id):
        return {
            "id": UNREADABLE_ID,
            "description": f"unreadable job: {job_id!r} is not a job id",
            "created_at": UNKNOWN_TIME,
        }
    try:
        job = fetch_job(redis, job_id)
    except NotFound:
        return None
    except NotRequeueable as exc:
        return {
            "id": job_id,
            "description": f"unreadable job: {exc}",
            "created_at": _stored_time(redis, job_id),
        }
    return {
        "id": job.id,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "ended_at": _iso(job.ended_at),
        "exc_info": latest_error(job),
        "description": job.description,
    }


def _stored_time(redis: Redis, job_id: str) -> str:
    """An unreadable job's creation time, if its hash holds a readable one."""
    raw = redis.hget(Job.key_for(job_id), "created_at")
    try:
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return _iso(utcparse(text)) or UNKNOWN_TIME
    except (UnicodeDecodeError, ValueError):
        return UNKNOWN_TIME


def _count(text: str, most: int) -> int | None:
    """`text` as a number from 1 to `most`, or None."""
    if not (text.isascii() and text.isdecimal() and len(text) <= len(str(most))):
        return None
    number = int(text)
    return number if 1 <= number <= most else None


def _current_job(worker: BaseWorker) -> str | dict[str, Any]:
    """The job `worker` is running, as the workers page reads it."""
    job_id = worker.get_current_job_id()
    if job_id is None:
        return "idle"
    if not JOB_ID_PATTERN.fullmatch(job_id):
        return {"job_id": UNREADABLE_ID, "call_string": UNREADABLE_ID}
    try:
        job = fetch_job(worker.connection, job_id)
    except (NotFound, NotRequeueable):
        return {"job_id": job_id, "call_string": UNREADABLE_ID}
    return {
        "job_id": job.id,
        "description": job.description,  # escaped by the page
        "created_at": _iso(job.created_at),
        "call_string": escape(job.get_call_string() or ""),
    }


#: The job page's fields it prints as HTML, and those it reads as times.
JOB_PAGE_TEXTS = ("description", "origin", "status", "result", "exc_info", "metadata")
JOB_PAGE_TIMES = ("created_at", "enqueued_at", "started_at", "ended_at")


def _job_page(job_id: str, **fields: Any) -> dict[str, Any]:
    """The job page's data: the texts escaped, the times as they are (the page
    shows a missing one as `-`, and `unknown` as an invalid date)."""
    page: dict[str, Any] = {"id": job_id}
    for name in JOB_PAGE_TEXTS:
        value = fields.get(name)
        page[name] = None if value is None else escape(str(value))
    for name in JOB_PAGE_TIMES:
        page[name] = fields.get(name)
    page["created_at"] = page["created_at"] or UNKNOWN_TIME
    return page


def _readable(read: Any) -> Any:
    """What `read()` returns, or why it could not be read."""
    try:
        return read()
    except Exception as exc:
        return f"unreadable: {exc.__class__.__name__}"


def _iso(value: datetime | None) -> str | None:
    """A job's time as rq-dashboard's pages read it: ISO 8601 in UTC."""
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).astimezone(UTC).isoformat()


def _requested_endpoint() -> str | None:
    """The view the request's path names, whatever its method: Flask leaves
    `request.endpoint` empty for a method the route does not take."""
    if request.url_rule is not None:
        return str(request.url_rule.endpoint)
    refused = request.routing_exception
    if not isinstance(refused, MethodNotAllowed) or not refused.valid_methods:
        return None
    adapter = current_app.create_url_adapter(request)
    if adapter is None:
        return None
    try:
        endpoint, _ = adapter.match(method=next(iter(refused.valid_methods)))
    except HTTPException:
        return None
    return str(endpoint)


def _refuse_forgery() -> str | None:
    """Why this state-changing request may be forged, or None when it is the dashboard's own."""
    if request.method != "POST":
        return "method"
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in {"same-origin", "none"}:
        return "cross_site"
    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc != request.host:
        return "cross_origin"
    cookie = request.cookies.get(CSRF_COOKIE, "")
    header = request.headers.get(CSRF_HEADER) or request.form.get(CSRF_FIELD, "")
    if not cookie or not _same(header, cookie):
        return "csrf_token"
    return None


def csrf_token() -> str:
    """The anti-forgery token of this browser: its cookie's, or a new one
    the response sets (for a page whose forms carry it)."""
    token = request.cookies.get(CSRF_COOKIE)
    if token:
        return token
    if "csrf_token" not in g:
        g.csrf_token = secrets.token_urlsafe(32)
    return str(g.csrf_token)


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _answer(status: str, code: int, **data: Any) -> tuple[Response, int]:
    return _answer_data(code, status=status, **data)


def _answer_data(code: int = 200, **data: Any) -> tuple[Response, int]:
    response = jsonify(**data)
    response.headers["Cache-Control"] = "no-store"
    return response, code
