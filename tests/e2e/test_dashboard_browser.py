"""The dashboard in a real headless Chromium: log in, requeue a dead-letter job, it succeeds."""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg import sql
from redis import Redis
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.conftest import PG_SERVER
from tests.factories import Factory, StandardEvent
from tests.processes import process_env, start, stop, wait_until

#: Set PAYHOOK_SCREENSHOT=docs/dashboard.png to refresh the README's picture.
SCREENSHOT = os.environ.get("PAYHOOK_SCREENSHOT")
USER, PASSWORD = "payhook", "browser-test-password"
#: Consumer settings that send a failing job to the dead-letter queue quickly:
#: one retry, after 1 s.
QUICK = {"PAYHOOK_JOB_RETRY_INTERVALS": "1", "PAYHOOK_MAINTENANCE_INTERVAL": "1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def unprivileged_url(database: str) -> Iterator[str]:
    """A URL of the test database for a role that may log in but read nothing:
    a deploy with broken grants."""
    role = f"payhook_test_broken_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    yield PG_SERVER.replace("//postgres@", f"//{role}@", 1) + f"/{database}"
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@pytest.mark.slow
def test_an_operator_requeues_a_dead_letter_job_in_the_browser_and_it_is_applied(
    settings: Settings,
    redis_conn: Redis,
    factory: Factory,
    tmp_path: Path,
    browser: WebDriver,
    unprivileged_url: str,
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    env = process_env(settings, **QUICK, PAYHOOK_DASHBOARD_PASSWORD=PASSWORD)
    quick = Settings.from_env(env)
    queue = events_queue(redis_conn, quick)
    # A consumer deployed with a role that cannot read the schema: the payment's
    # job fails, is retried once, fails again and lands in the dead-letter queue.
    broken = start(
        ["consumer"],
        env | {"DATABASE_URL": unprivileged_url, "PAYHOOK_DATABASE_ROLE": ""},
        tmp_path / "broken.log",
    )
    envelope = factory.standard_envelope(shop, StandardEvent())
    job = enqueue_event(queue, envelope, quick)
    port = free_port()
    dashboard = start(["dashboard", "--port", str(port)], env, tmp_path / "dashboard.log")
    fixed: subprocess.Popen[bytes] | None = None
    try:
        wait_until(
            lambda: job.id in FailedJobRegistry(queue=queue).get_job_ids(),
            60,
            "the job to reach the dead-letter queue",
        )
        # The deploy is fixed: the right consumer replaces the broken one.
        stop(broken)
        fixed = start(["consumer"], env, tmp_path / "consumer.log")
        assert factory.order_state(shop, order_id) == "pending"

        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(f"{base}/healthz"), 30, "the dashboard")
        # Without credentials the browser gets nothing of the dashboard.
        browser.get(f"{base}/0/view/jobs/{quick.queue}/failed/8/asc/1")
        assert browser.title != "RQ dashboard"
        assert "RQ-dashboard" not in browser.page_source

        failed = f"/0/view/jobs/{quick.queue}/failed/8/asc/1"
        browser.get(f"http://{USER}:{PASSWORD}@127.0.0.1:{port}{failed}")
        row = f'tr[data-job-id="{job.id}"]'
        button = WebDriverWait(browser, 30).until(
            lambda b: b.find_element(By.CSS_SELECTOR, f"{row} [data-role=requeue-job-btn]")
        )
        # The failure as RQ keeps it: the class and SQLSTATE, never the error's text.
        failure = browser.find_element(By.CSS_SELECTOR, row).text
        assert "InsufficientPrivilege, SQLSTATE 42501" in failure
        assert browser.get_screenshot_as_png().startswith(b"\x89PNG")
        if SCREENSHOT:
            assert browser.save_screenshot(SCREENSHOT)

        button.click()
        wait_until(
            lambda: _status(redis_conn, job.id) == JobStatus.FINISHED,
            60,
            "the requeued job to succeed",
        )
        WebDriverWait(browser, 30).until(lambda b: not b.find_elements(By.CSS_SELECTOR, row))
        result = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
        assert result.return_value() == {"outcome": "applied", "order_id": order_id, "retries": 0}
        assert factory.order_state(shop, order_id) == "paid"
        assert factory.count("payment_outbox", order_id=order_id) == 1
        assert FailedJobRegistry(queue=queue).get_job_ids() == []

        # Compact, Empty and Delete are refused by the server; no page shows them.
        refused = "#compact-btn, #empty-btn, [data-role=delete-job-btn]"
        for registry in ("queued", "failed"):
            view = f"/0/view/jobs/{quick.queue}/{registry}/8/asc/1"
            browser.get(f"http://{USER}:{PASSWORD}@127.0.0.1:{port}{view}")
            WebDriverWait(browser, 30).until(
                lambda b: "Loading" not in b.find_element(By.ID, "jobs").text
            )
            shown = [b for b in browser.find_elements(By.CSS_SELECTOR, refused) if b.is_displayed()]
            assert shown == [], registry
            if registry == "queued":
                assert browser.find_elements(By.ID, "compact-btn"), "rq-dashboard's page, hidden"
        assert browser.find_element(By.ID, "requeue-all-btn").is_displayed()
    finally:
        stop(dashboard)
        stop(broken)
        if fixed is not None:
            stop(fixed)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _status(redis_conn: Redis, job_id: str) -> JobStatus | None:
    return Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer).get_status()
