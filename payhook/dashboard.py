"""`payhook dashboard`: rq-dashboard on the events queue, made safe for JSON jobs.

rq-dashboard 0.9 as shipped does not fit payhook, so this module wraps it:

- it reads jobs with the pickle serializer in several views, and its requeue
  buttons call RQ without a serializer: here every job is read as JSON, and
  requeue goes through `payhook.operations.requeue_dead_letter` (JSON, events
  queue only, `apply_event` jobs only, a fresh retry budget);
- its command binds 0.0.0.0: here the default is 127.0.0.1, and any other
  address needs `PAYHOOK_DASHBOARD_PASSWORD`;
- it has no authentication: here every page needs HTTP basic auth (without a
  password on loopback, one is generated for the run and printed once);
- "requeue all" answers a plain GET and nothing checks where a request comes
  from: here a state change must be a POST from the dashboard's own pages,
  carrying the `_csrf_token` cookie's value in `X-CSRFToken` (its own
  JavaScript already sends it), and no browser may frame the pages;
- deleting jobs is off: a dead-letter job is the only copy of an event the
  gateway will not send again.

| variable | default | meaning |
|---|---|---|
| `PAYHOOK_DASHBOARD_HOST` | 127.0.0.1 | address to listen on |
| `PAYHOOK_DASHBOARD_PORT` | 9181 | port to listen on |
| `PAYHOOK_DASHBOARD_USER` | payhook | basic-auth user |
| `PAYHOOK_DASHBOARD_PASSWORD` | (none) | basic-auth password; required off loopback |

`GET /healthz` answers without credentials; `GET /metrics` (with them) exports
the alert signals (`payhook.alerts`) for Prometheus.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
import signal
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import structlog
from flask import Flask, Response, current_app, jsonify, render_template, request, url_for
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from rq import Worker
from rq.job import Job
from rq.serializers import JSONSerializer
from werkzeug.serving import make_server

from payhook.alerts import AlertCollector, AlertConfig, Signal, read_signals
from payhook.db import connect
from payhook.errors import NotFound, SettingsError
from payhook.logs import configure_logging
from payhook.operations import (
    NotRequeueable,
    requeue_all_dead_letters,
    requeue_dead_letter,
)
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
#: Views that change state: POST only, and only from the dashboard's own pages.
STATE_CHANGING = frozenset(
    {
        "rq_dashboard.requeue_job_view",
        "rq_dashboard.requeue_all",
        "rq_dashboard.delete_job_view",
        "rq_dashboard.empty_queue",
        "rq_dashboard.compact_queue",
    }
)
#: Paths answered without credentials.
PUBLIC_PATHS = frozenset({"/healthz"})
#: Milliseconds between two refreshes of a dashboard page.
POLL_INTERVAL_MS = 2500


@dataclass(frozen=True)
class DashboardConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    user: str = DEFAULT_USER
    password: Secret | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> DashboardConfig:
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

    def bound(self, host: str | None, port: int | None) -> DashboardConfig:
        """This config listening where the command line says; refused without a password
        off loopback."""
        config = DashboardConfig(
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
    web.config.serializer = JSONSerializer
    # The pages ask for `/static/...` from both the app and the blueprint: serve
    # rq-dashboard's files from both, as its own command does.
    app = Flask(__name__, static_folder=web.blueprint.static_folder)
    app.config.from_object(rq_dashboard.default_settings)
    app.config.update(
        RQ_DASHBOARD_REDIS_URL=str(settings.redis_url),
        RQ_DASHBOARD_DISABLE_DELETE=True,
        RQ_DASHBOARD_POLL_INTERVAL=POLL_INTERVAL_MS,
        RQ_DASHBOARD_SHOW_FULL_ARGS=False,
    )
    app.register_blueprint(web.blueprint)
    web.setup_rq_connection(app)
    redis = redis_connection(settings, timeout=10)
    alert_config = AlertConfig.from_settings(settings)

    def read_alerts() -> list[Signal]:
        with connect(settings, "dashboard") as conn:
            return read_signals(conn, redis, settings, alert_config)

    metrics = CollectorRegistry(auto_describe=False)
    metrics.register(AlertCollector(read_alerts))

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

    @app.after_request
    def harden(response: Response) -> Response:
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Content-Security-Policy"] = "frame-ancestors 'none'"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        if request.path not in PUBLIC_PATHS and not request.cookies.get(CSRF_COOKIE):
            response.set_cookie(
                CSRF_COOKIE,
                secrets.token_urlsafe(32),
                samesite="Strict",
                secure=request.is_secure,
                httponly=False,  # the dashboard's JavaScript reads it
            )
        return response

    def requeue_job_view(job_id: str) -> tuple[Response, int]:
        try:
            requeue_dead_letter(redis, settings, job_id)
        except NotFound as exc:
            return _answer("ERROR", 404, job_id=job_id, reason=str(exc))
        except NotRequeueable as exc:
            return _answer("ERROR", 409, job_id=job_id, reason=str(exc))
        log.info("dashboard_job_requeued", job_id=job_id, user=user)
        return _answer("OK", 200, job_id=job_id)

    def requeue_all(queue_name: str) -> tuple[Response, int]:
        if queue_name != settings.queue:
            return _answer("ERROR", 409, reason=f"only {settings.queue!r} is requeued here")
        requeued, refused = requeue_all_dead_letters(redis, settings)
        log.info("dashboard_jobs_requeued", requeued=len(requeued), refused=len(refused))
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

    def list_workers(instance_number: int) -> tuple[Response, int]:
        workers = [
            {
                "name": worker.name,
                "pid": worker.pid,
                "queues": [q.name for q in worker.queues],
                "state": str(worker.get_state()),
                "current_job": web.serialize_current_job(worker.get_current_job()),
                "last_heartbeat": worker.last_heartbeat,
                "birth_date": worker.birth_date,
                "successful_job_count": worker.successful_job_count,
                "failed_job_count": worker.failed_job_count,
                "total_working_time": worker.total_working_time,
                "version": getattr(worker, "version", ""),
                "python_version": getattr(worker, "python_version", ""),
            }
            for worker in Worker.all(connection=redis, serializer=JSONSerializer)
        ]
        workers.sort(key=lambda w: (w["state"], w["queues"], w["name"]))
        return jsonify(workers=workers), 200

    # rq-dashboard's own views for these read jobs with pickle or requeue
    # without the serializer; the URLs stay, the functions are ours.
    app.view_functions["rq_dashboard.requeue_job_view"] = requeue_job_view
    app.view_functions["rq_dashboard.requeue_all"] = requeue_all
    app.view_functions["rq_dashboard.job_view"] = job_view
    app.view_functions["rq_dashboard.list_workers"] = list_workers

    @app.get("/healthz")
    def healthz() -> Response:
        return Response('{"status": "ok"}\n', mimetype="application/json")

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics), mimetype=CONTENT_TYPE_LATEST)

    return app


def run(settings: Settings, host: str | None = None, port: int | None = None) -> int:
    """Serve the dashboard until SIGTERM or SIGINT."""
    configure_logging(settings.log_level)
    config = DashboardConfig.from_settings(settings).bound(host, port)
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

    def stop(signum: int, frame: FrameType | None) -> None:
        log.info("dashboard_stopping", signal=signal.Signals(signum).name)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info(
        "dashboard_started",
        url=f"http://{config.host}:{server.server_port}/",
        user=config.user,
        queue=settings.queue,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    log.info("dashboard_stopped")
    return 0


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
    header = request.headers.get(CSRF_HEADER, "")
    if not cookie or not _same(header, cookie):
        return "csrf_token"
    return None


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _answer(status: str, code: int, **data: Any) -> tuple[Response, int]:
    response = jsonify(status=status, **data)
    response.headers["Cache-Control"] = "no-store"
    return response, code
