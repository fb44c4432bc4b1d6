"""The dashboard app against real Redis: credentials, forgery guards, JSON-only requeue."""

from __future__ import annotations

import base64
import html
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest
from flask import Response
from flask.testing import FlaskClient
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from redis.typing import EncodableT, FieldT
from rq import Queue, Worker
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker_registration import REDIS_WORKER_KEYS
from structlog.testing import capture_logs

from control.dashboard import (
    CSRF_COOKIE,
    CSRF_HEADER,
    REFUSED,
    REGISTRIES,
    STATE_CHANGING,
    create_app,
)
from payhook import quarantine
from payhook.db import connect
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.conftest import REDIS_TEST_URL, test_settings
from tests.factories import Factory, StandardEvent
from tests.integration.test_alerts_signals import locked
from tests.integration.test_ops_commands import dead_letter, plant_pickled_job

USER, PASSWORD = "operator", "correct horse"
AUTH = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
HOST = "localhost"


@pytest.fixture
def client(settings: Settings) -> FlaskClient:
    return create_app(settings, USER, PASSWORD).test_client()


def token(client: FlaskClient) -> str:
    """Open a page as the operator's browser does; the anti-forgery cookie it sets."""
    assert client.get("/", headers=AUTH).status_code == 200
    cookie = client.get_cookie(CSRF_COOKIE)
    assert cookie is not None and cookie.same_site == "Strict"
    return cookie.value


def own_page(csrf: str) -> dict[str, str]:
    """Headers of a POST the dashboard's own JavaScript sends."""
    return AUTH | {
        CSRF_HEADER: csrf,
        "Origin": f"http://{HOST}",
        "Sec-Fetch-Site": "same-origin",
    }


def failed_event_job(factory: Factory, settings: Settings, redis_conn: Redis) -> Job:
    shop = factory.shop()
    factory.order(shop)
    queue = events_queue(redis_conn, settings)
    envelope = factory.standard_envelope(shop, StandardEvent())
    return dead_letter(redis_conn, queue, enqueue_event(queue, envelope, settings))


def test_every_page_needs_the_credentials(client: FlaskClient) -> None:
    wrong = {"Authorization": "Basic " + base64.b64encode(b"operator:guess").decode()}
    for path in ("/", "/0/data/queues.json", "/0/view/workers", "/metrics", "/static/css/main.css"):
        for headers in ({}, wrong):
            answer = client.get(path, headers=headers)
            assert answer.status_code == 401, path
            assert answer.headers["WWW-Authenticate"].startswith("Basic ")
    assert client.get("/healthz").status_code == 200
    page = client.get("/", headers=AUTH)
    assert page.status_code == 200
    assert page.headers["X-Frame-Options"] == "DENY"
    for asset in ("/static/js/jquery-3.5.1.min.js", "/static/css/main.css", "/static/favicon.ico"):
        with client.get(asset, headers=AUTH) as served:
            assert served.status_code == 200, asset


def test_requeue_from_the_dashboard_puts_the_json_job_back_on_the_events_queue(
    client: FlaskClient, factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    job = failed_event_job(factory, settings, redis_conn)
    listed = client.get(
        f"/0/data/jobs/{settings.queue}/failed/8/asc/1.json", headers=AUTH
    ).get_json()
    assert [j["id"] for j in listed["jobs"]] == [job.id]
    metrics = client.get("/metrics", headers=AUTH).get_data(as_text=True)
    assert 'payhook_alert_value{alert="dead_letter_jobs"} 1.0' in metrics
    assert "payhook_alerts_up 1.0" in metrics

    answer = client.post(f"/job/{job.id}/requeue", headers=own_page(token(client)))
    assert answer.status_code == 200, answer.get_data(as_text=True)
    queue = events_queue(redis_conn, settings)
    assert queue.get_job_ids() == [job.id]
    assert FailedJobRegistry(queue=queue).get_job_ids() == []
    again = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert again.func_name == "consumer.jobs.apply_event"
    assert again.retries_left == len(settings.job_retry_intervals)
    assert again.meta == {}


def test_state_changes_refuse_get_and_forged_posts(
    client: FlaskClient, factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    job = failed_event_job(factory, settings, redis_conn)
    csrf = token(client)
    requeue_all = f"/requeue/{settings.queue}"
    assert client.get(requeue_all, headers=AUTH).status_code == 405
    forged = [
        AUTH,  # a cross-site form: the browser adds the credentials, not the token
        own_page(csrf) | {CSRF_HEADER: "guessed"},
        own_page(csrf) | {"Origin": "https://evil.example"},
        own_page(csrf) | {"Sec-Fetch-Site": "cross-site"},
    ]
    for headers in forged:
        assert client.post(requeue_all, headers=headers).status_code == 403, headers
        assert client.post(f"/job/{job.id}/requeue", headers=headers).status_code == 403
    assert FailedJobRegistry(queue=events_queue(redis_conn, settings)).get_job_ids() == [job.id]

    answer = client.post(requeue_all, headers=own_page(csrf))
    assert answer.get_json() == {"status": "OK", "count": 1, "refused": []}
    assert events_queue(redis_conn, settings).get_job_ids() == [job.id]


#: HTTP methods a refused action is tried with.
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def refused_paths(queue: str, job_ids: list[str]) -> list[str]:
    """rq-dashboard's actions that drop job ids or move them one at a time."""
    empty = [f"/queue/{queue}/{name}/empty" for name in ("queued", *REGISTRIES)]
    return [f"/queue/{queue}/compact", *empty, *(f"/job/{job_id}/delete" for job_id in job_ids)]


def jobs_in_redis(redis_conn: Redis, settings: Settings) -> dict[str, Any]:
    """Where every job of the events queue is, and which job hashes exist."""
    queue = events_queue(redis_conn, settings)
    return {
        "queued": queue.get_job_ids(),
        "failed": FailedJobRegistry(queue=queue).get_job_ids(),
        "hashes": sorted(redis_conn.keys("rq:job:*")),
        "compacting": redis_conn.keys("rq:queue:_compact:*"),
    }


def test_actions_that_drop_or_shuffle_job_ids_are_refused_whatever_the_request(
    client: FlaskClient, factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """Compact, empty and delete are refused, with any method, with or without
    the anti-forgery token, logged, and every job stays where it was."""
    failed = failed_event_job(factory, settings, redis_conn)
    queue = events_queue(redis_conn, settings)
    shop = factory.shop()
    queued = [
        enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings).id
        for _ in range(3)
    ]
    before = jobs_in_redis(redis_conn, settings)
    assert before["queued"] == queued and before["failed"] == [failed.id]
    csrf = token(client)
    for path in refused_paths(settings.queue, [failed.id, queued[0]]):
        for method in METHODS:
            for headers in (AUTH, own_page(csrf)):
                with capture_logs() as logs:
                    answer = client.open(path, method=method, headers=headers)
                assert answer.status_code == 403, (method, path)
                if method != "HEAD":
                    body = answer.get_json()
                    assert body["status"] == "REFUSED", (method, path)
                    assert body["reason"].startswith("not offered by payhook's dashboard: ")
                assert [log["event"] for log in logs] == ["dashboard_action_refused"]
                assert logs[0]["method"] == method and logs[0]["user"] == USER
        assert client.post(path, headers={}).status_code == 401
    assert jobs_in_redis(redis_conn, settings) == before


#: rq-dashboard's own views left in place: each reads Redis and writes nothing.
READ_ONLY_VIEWS = {
    "rq_dashboard.queues_overview",
    "rq_dashboard.workers_overview",
    "rq_dashboard.jobs_overview",
    "rq_dashboard.list_queues",
    "rq_dashboard.favicon",
    "rq_dashboard.static",
}


def test_every_view_that_could_move_jobs_is_payhooks_own_or_refused(
    client: FlaskClient, settings: Settings
) -> None:
    """Each rq-dashboard view that takes a POST either is replaced by one of
    payhook's (requeue, one atomic move per job) or refuses, even past the
    guard; every other view of rq-dashboard's own still in place only reads."""
    app = client.application
    for rule in app.url_map.iter_rules():
        view = app.view_functions[rule.endpoint]
        if not rule.endpoint.startswith("rq_dashboard."):
            continue
        if "POST" in (rule.methods or ()):
            assert rule.endpoint in STATE_CHANGING | set(REFUSED), rule
            assert view.__module__ == "control.dashboard", rule
        elif view.__module__ != "control.dashboard":
            assert rule.endpoint in READ_ONLY_VIEWS, rule
    for endpoint in REFUSED:
        with app.test_request_context(method="POST", headers=AUTH):
            answer = app.view_functions[endpoint](job_id="x", queue_name="q", registry_name="r")
        assert isinstance(answer, Response)
        assert answer.status_code == 403, endpoint


def test_compact_and_empty_of_an_empty_queue_are_refused_not_a_server_error(
    client: FlaskClient, settings: Settings, redis_conn: Redis
) -> None:
    csrf = token(client)
    for path in refused_paths(settings.queue, []):
        answer = client.post(path, headers=own_page(csrf))
        assert answer.status_code == 403, path
        assert answer.get_json()["action"] in {"compact_queue", "empty_queue"}
    assert jobs_in_redis(redis_conn, settings) == {
        "queued": [],
        "failed": [],
        "hashes": [],
        "compacting": [],
    }


#: The rule hiding the buttons of the refused actions from the jobs page.
HIDDEN = "#compact-btn, #empty-btn, [data-role=delete-job-btn] { display: none !important; }"


def test_the_jobs_page_hides_the_buttons_of_refused_actions(
    client: FlaskClient, settings: Settings
) -> None:
    for registry in ("queued", "failed"):
        page = client.get(f"/0/view/jobs/{settings.queue}/{registry}/8/asc/1", headers=AUTH)
        assert page.status_code == 200
        text = page.get_data(as_text=True)
        assert HIDDEN in text
        assert text.index(HIDDEN) < text.index('id="filter-form"'), "rq-dashboard's page follows"
    requeue_all = f"/requeue/{settings.queue}"
    assert requeue_all in client.get(
        f"/0/view/jobs/{settings.queue}/failed/8/asc/1", headers=AUTH
    ).get_data(as_text=True)


def test_no_dashboard_view_unpickles_what_redis_holds(
    client: FlaskClient, settings: Settings, redis_conn: Redis, tmp_path: Path
) -> None:
    """rq-dashboard's own views read jobs with pickle; whoever writes Redis would run code."""
    marker = tmp_path / "unpickled"
    queue = events_queue(redis_conn, settings)
    job_id = plant_pickled_job(redis_conn, queue, marker)
    worker = Worker([Queue(settings.queue, connection=redis_conn)], connection=redis_conn)
    worker.register_birth()
    redis_conn.hset(worker.key, "current_job", job_id)
    try:
        for path in (
            f"/0/view/job/{job_id}",
            f"/0/data/job/{job_id}.json",
            f"/0/data/jobs/{settings.queue}/failed/8/asc/1.json",
            "/0/data/workers.json",
            "/0/view/workers",
            "/0/data/queues.json",
        ):
            client.get(path, headers=AUTH)
        answer = client.post(f"/job/{job_id}/requeue", headers=own_page(token(client)))
        assert answer.status_code == 409
    finally:
        worker.register_death()
    assert not marker.exists()


def test_requeue_of_an_unknown_job_is_a_404(client: FlaskClient) -> None:
    answer = client.post(f"/job/{uuid.uuid4()}/requeue", headers=own_page(token(client)))
    assert answer.status_code == 404


def dead_letter_list(client: FlaskClient, settings: Settings, tail: str = "8/asc/1") -> Any:
    answer = client.get(f"/0/data/jobs/{settings.queue}/failed/{tail}.json", headers=AUTH)
    assert answer.status_code == 200, answer.get_data(as_text=True)[:300]
    return answer.get_json()


def test_one_unreadable_job_hides_no_other_in_the_dead_letter_list(
    client: FlaskClient, factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """A job hash RQ cannot read, or a job result it cannot decode (forged,
    damaged), is listed as unreadable beside the others."""
    good = failed_event_job(factory, settings, redis_conn)
    damaged_result = failed_event_job(factory, settings, redis_conn)
    redis_conn.xadd(f"rq:results:{damaged_result.id}", {"type": "2", "exc_string": "bm90IHpsaWI="})
    registry = FailedJobRegistry(queue=events_queue(redis_conn, settings))
    unreadable = redis_conn.hgetall(good.key) | {b"created_at": b"not a date"}
    redis_conn.hset("rq:job:bad-date", mapping=cast(dict[FieldT, EncodableT], unreadable))
    redis_conn.zadd(registry.key, {"bad-date": time.time() + 86400})

    listed = {job["id"]: job for job in dead_letter_list(client, settings)["jobs"]}
    assert set(listed) == {good.id, damaged_result.id, "bad-date"}
    assert listed["bad-date"]["description"].startswith("unreadable job: job bad-date")
    assert listed["bad-date"]["created_at"] == "unknown", "not 'just now' on every refresh"
    assert not listed["bad-date"].get("exc_info"), "no requeue button: requeue refuses it"
    assert listed[damaged_result.id]["exc_info"] == "unreadable result: zlib.error"
    assert listed[good.id]["description"] == f"apply_event delivery={good.id}"
    assert "runs only in a payhook consumer" in listed[good.id]["exc_info"]
    assert listed[good.id]["created_at"].endswith("+00:00")


def test_the_dashboard_job_lists_page_through_every_job(
    client: FlaskClient, factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    for _ in range(3):
        failed_event_job(factory, settings, redis_conn)
    # in the registry's order: by expiry, then id
    jobs = FailedJobRegistry(queue=events_queue(redis_conn, settings)).get_job_ids()
    assert len(jobs) == 3
    first = dead_letter_list(client, settings, "2/asc/1")
    assert [job["id"] for job in first["jobs"]] == jobs[:2]
    assert first["pagination"]["num_pages"] == 2 and "next_page" in first["pagination"]
    assert "prev_page" not in first["pagination"]
    second = dead_letter_list(client, settings, "2/asc/2")
    assert [job["id"] for job in second["jobs"]] == jobs[2:]
    assert "next_page" not in second["pagination"] and "prev_page" in second["pagination"]
    newest = dead_letter_list(client, settings, "2/dsc/1")
    assert [job["id"] for job in newest["jobs"]] == jobs[:0:-1]

    queue = events_queue(redis_conn, settings)
    waiting = [
        enqueue_event(
            queue, factory.standard_envelope(factory.shop(), StandardEvent()), settings
        ).id
        for _ in range(3)
    ]
    for tail, expected in (
        ("8/asc/1", waiting),
        ("2/asc/2", waiting[2:]),
        ("2/dsc/1", waiting[:0:-1]),
    ):
        answer = client.get(f"/0/data/jobs/{settings.queue}/queued/{tail}.json", headers=AUTH)
        assert [job["id"] for job in answer.get_json()["jobs"]] == expected, tail
    for path in (f"{settings.queue}/nowhere/8/asc/1", f"{settings.queue}/failed/0/asc/1"):
        assert client.get(f"/0/data/jobs/{path}.json", headers=AUTH).status_code == 404


#: What a forged registry member, queue entry or worker name would run in the
#: operator's browser if a page printed it as HTML.
MARKUP = "<img src=x onerror=alert(document.cookie)>"
#: Fields the dashboard's job and worker pages escape themselves.
ESCAPED = {"description", "exc_info"}


def unescaped_text(rows: Any) -> list[str]:
    """Every string in `rows` the dashboard's pages print as HTML, unescaped."""
    if isinstance(rows, str):
        return [rows]
    if isinstance(rows, list):
        return [text for row in rows for text in unescaped_text(row)]
    if isinstance(rows, dict):
        return [text for k, v in rows.items() if k not in ESCAPED for text in unescaped_text(v)]
    return []


def test_no_forged_id_or_name_reaches_the_pages_as_html(
    client: FlaskClient, factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """rq-dashboard's pages print a job's id and a worker's fields as HTML;
    whoever writes Redis must not run script in the operator's session."""
    good = failed_event_job(factory, settings, redis_conn)
    queue = events_queue(redis_conn, settings)
    registry = FailedJobRegistry(queue=queue)
    redis_conn.zadd(registry.key, {MARKUP: time.time() + 86400})
    redis_conn.rpush(queue.key, MARKUP)
    # a job hash RQ reads, under an id RQ would never give
    good_hash = cast(dict[FieldT, EncodableT], redis_conn.hgetall(good.key))
    redis_conn.hset(Job.key_for(MARKUP), mapping=good_hash)
    # a job RQ cannot read, but whose creation time is readable
    unreadable_hash = redis_conn.hgetall(good.key) | {b"status": b"no such status"}
    redis_conn.hset("rq:job:bad-status", mapping=cast(dict[FieldT, EncodableT], unreadable_hash))
    redis_conn.zadd(registry.key, {"bad-status": time.time() + 86400})
    worker = Worker([queue], connection=redis_conn, serializer=JSONSerializer)
    worker.register_birth()
    forged = f"{Worker.redis_worker_namespace_prefix}{MARKUP}"
    fields: dict[FieldT, EncodableT] = {
        b"version": MARKUP.encode(),
        b"python_version": MARKUP.encode(),
    }
    redis_conn.hset(forged, mapping=redis_conn.hgetall(worker.key) | fields)
    redis_conn.sadd(REDIS_WORKER_KEYS, forged)
    try:
        failed = dead_letter_list(client, settings)["jobs"]
        queued = client.get(f"/0/data/jobs/{settings.queue}/queued/8/asc/1.json", headers=AUTH)
        workers = client.get("/0/data/workers.json", headers=AUTH).get_json()["workers"]
    finally:
        redis_conn.srem(REDIS_WORKER_KEYS, forged)
        redis_conn.delete(forged)
        worker.register_death()
    assert len(workers) == 2
    rows = failed + queued.get_json()["jobs"]
    assert len(failed) == 3 and len(queued.get_json()["jobs"]) == 1
    for text in unescaped_text(rows) + unescaped_text(workers):
        assert "<" not in text and ">" not in text, text
    unreadable = [row for row in rows if row["id"] == "(unreadable)"]
    assert [row["description"] for row in unreadable] == [
        f"unreadable job: {MARKUP!r} is not a job id"
    ] * 2
    assert {row["created_at"] for row in unreadable} == {"unknown"}
    [bad_status] = [row for row in failed if row["id"] == "bad-status"]
    assert bad_status["description"].startswith("unreadable job: job bad-status")
    [good_row] = [row for row in failed if row["id"] == good.id]
    assert bad_status["created_at"] == good_row["created_at"]
    assert [w["name"] for w in workers if "img" in w["name"]] == [
        "&lt;img src=x onerror=alert(document.cookie)&gt;"
    ]


@pytest.mark.parametrize(
    "tail",
    [
        "\u00b2/asc/1",
        "8/asc/\u00b2",
        "\u0663/asc/1",
        "9" * 30 + "/asc/1",
        "8/asc/" + "9" * 30,
        "1001/asc/1",
        "8/asc/1000000001",
        "0/asc/1",
        "8/asc/0",
    ],
)
def test_a_page_out_of_range_is_a_404(client: FlaskClient, settings: Settings, tail: str) -> None:
    answer = client.get(f"/0/data/jobs/{settings.queue}/failed/{tail}.json", headers=AUTH)
    assert answer.status_code == 404, answer.get_data(as_text=True)[:300]
    most = client.get(
        f"/0/data/jobs/{settings.queue}/failed/1000/dsc/1000000000.json", headers=AUTH
    )
    assert most.status_code == 200 and most.get_json()["jobs"] == []


SECRET = "s3cr3t-redis-pw"


@pytest.fixture
def redis_user(redis_conn: Redis) -> Iterator[str]:
    """A Redis user of its own, for the duration of one test; its password is set by the test."""
    name = f"payhook-dashboard-{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        redis_conn.acl_deluser(name)


def connected_as(redis_conn: Redis, user: str) -> list[dict[str, Any]]:
    return [client for client in redis_conn.client_list() if client.get("user") == user]


@pytest.mark.parametrize(
    ("url", "password"),
    [
        ("redis://{user}:{password}@{server}", SECRET),
        # redis-py reads the credentials from the query string too
        ("redis://{server}?username={user}&password={password}", SECRET),
        # an unescaped '@' in the password: redis-py splits at the last one
        ("redis://{user}:{password}@{server}", f"{SECRET[:6]}@{SECRET[6:]}"),
    ],
)
def test_no_dashboard_page_shows_the_redis_password(
    factory: Factory, database: str, redis_conn: Redis, redis_user: str, url: str, password: str
) -> None:
    redis_conn.acl_setuser(
        redis_user,
        enabled=True,
        passwords=[f"+{password}"],
        keys=["*"],
        channels=["*"],
        commands=["+@all"],
    )
    # The tests' own Redis database, as host:port/db.
    server = REDIS_TEST_URL.removeprefix("redis://")
    settings = test_settings(
        database, REDIS_URL=url.format(user=redis_user, password=password, server=server)
    )
    client = create_app(settings, USER, PASSWORD).test_client()
    job = failed_event_job(factory, settings, redis_conn)
    for path in (
        "/",
        "/0/view/workers",
        f"/0/view/jobs/{settings.queue}/failed/8/asc/1",
        f"/0/view/job/{job.id}",
        "/0/data/queues.json",
        f"/0/data/jobs/{settings.queue}/failed/8/asc/1.json",
    ):
        page = client.get(path, headers=AUTH)
        text = page.get_data(as_text=True)
        assert page.status_code == 200, path
        assert SECRET[6:] not in text and "password" not in text, path
    assert f"redis://{server}<" in client.get("/", headers=AUTH).get_data(as_text=True)
    # The views still reach Redis, as the user the URL names: the navbar's URL
    # has no credentials, and would connect as the default user.
    fresh = create_app(settings, USER, PASSWORD).test_client()
    redis_conn.client_kill_filter(user=redis_user)
    assert connected_as(redis_conn, redis_user) == []
    queues = fresh.get("/0/data/queues.json", headers=AUTH).get_json()["queues"]
    assert {"name": settings.queue, "failed_job_registry_count": 1}.items() <= {
        k: v for queue in queues if queue["name"] == settings.queue for k, v in queue.items()
    }.items()
    assert connected_as(redis_conn, redis_user), "queues.json did not connect with the credentials"
    assert fresh.get("/1/view/workers", headers=AUTH).status_code == 404


def alerts_up(client: FlaskClient) -> float:
    answer = client.get("/metrics", headers=AUTH)
    assert answer.status_code == 200
    [up] = [
        sample.value
        for family in text_string_to_metric_families(answer.get_data(as_text=True))
        for sample in family.samples
        if sample.name == "payhook_alerts_up"
    ]
    return up


def test_metrics_cannot_tell_rather_than_hang_behind_a_locked_table(
    database: str, redis_conn: Redis
) -> None:
    settings = test_settings(database, PAYHOOK_ALERT_TIMEOUT="200ms")
    client = create_app(settings, USER, PASSWORD).test_client()
    assert alerts_up(client) == 1
    with locked(settings, "security_anomalies"):
        started = time.monotonic()
        assert alerts_up(client) == 0
        assert time.monotonic() - started < 3
    assert alerts_up(client) == 1


def test_scrapes_behind_a_locked_table_hold_one_connection_at_most(
    database: str, redis_conn: Redis
) -> None:
    """Scrapes keep coming while a table is locked: they wait for the read in
    progress, never each with a connection of its own."""
    settings = test_settings(database, PAYHOOK_ALERT_TIMEOUT="300ms")
    app = create_app(settings, USER, PASSWORD)
    most = 0
    with (
        connect(settings, "test", owner=True) as watcher,
        locked(settings, "payment_outbox"),
        ThreadPoolExecutor(6) as pool,
    ):
        scrapes = [pool.submit(alerts_up, app.test_client()) for _ in range(6)]
        while not all(scrape.done() for scrape in scrapes):
            row = watcher.execute(
                "SELECT count(*) AS n FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'payhook-dashboard'"
            ).fetchone()
            assert row is not None
            most = max(most, row["n"])
            time.sleep(0.02)
        assert [scrape.result() for scrape in scrapes] == [0] * 6
    assert most == 1


def test_the_job_page_escapes_every_field_and_shows_an_unreadable_job(
    client: FlaskClient, factory: Factory, settings: Settings, redis_conn: Redis
) -> None:
    """rq-dashboard's job page prints each field of its data as HTML, and
    rq-dashboard's own data view fails on a job RQ cannot read."""
    job = failed_event_job(factory, settings, redis_conn)
    redis_conn.hset(job.key, mapping={"description": MARKUP, "origin": MARKUP})
    page = client.get(f"/0/data/job/{job.id}.json", headers=AUTH)
    assert page.status_code == 200
    data = page.get_json()
    assert data["description"] == data["origin"] == html.escape(MARKUP)
    for name in ("description", "origin", "status", "result", "exc_info", "metadata"):
        assert "<" not in str(data[name]) and ">" not in str(data[name]), name
    assert data["status"] == "failed"  # the page's requeue button
    assert data["created_at"] and data["ended_at"]

    damaged = redis_conn.hgetall(job.key) | {b"status": b"no such status"}
    redis_conn.hset("rq:job:damaged", mapping=cast(dict[FieldT, EncodableT], damaged))
    unreadable = client.get("/0/data/job/damaged.json", headers=AUTH)
    assert unreadable.status_code == 200
    assert unreadable.get_json()["description"].startswith("unreadable job: ")
    assert client.get("/0/data/job/gone.json", headers=AUTH).status_code == 404


def test_the_quarantine_page_lists_what_consumers_set_aside_escaped(
    client: FlaskClient, settings: Settings, redis_conn: Redis
) -> None:
    assert "Nothing is quarantined" in client.get("/quarantine", headers=AUTH).get_data(True)
    quarantine.move(redis_conn, settings.queue, b"<script>\xff", "status: not a status RQ knows")
    assert client.get("/quarantine").status_code == 401
    page = client.get("/quarantine", headers=AUTH).get_data(as_text=True)
    assert "&lt;script&gt;\\xff" in page and "<script>" not in page
    assert "status: not a status RQ knows" in page
    data = client.get("/quarantine?format=json", headers=AUTH).get_json()
    assert [(j["job_id"], j["reason"]) for j in data["jobs"]] == [
        ("<script>\\xff", "status: not a status RQ knows")
    ]
