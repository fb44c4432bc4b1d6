"""The dashboard app against real Redis: credentials, forgery guards, JSON-only requeue."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from redis import Redis
from rq import Queue, Worker
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from payhook.dashboard import CSRF_COOKIE, CSRF_HEADER, create_app
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import Factory, StandardEvent
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
