"""A real dashboard process killed while an operator's bulk actions run: no job is lost."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from redis import Redis
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from consumer.worker import PayhookJob, PayhookWorker
from control.dashboard import CSRF_COOKIE, CSRF_HEADER
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.e2e.test_dashboard_browser import free_port
from tests.factories import Factory, StandardEvent
from tests.processes import process_env, start, stop, wait_until

USER, PASSWORD = "payhook", "bulk-actions-test-password"
#: Jobs in the dead-letter queue, and jobs waiting on the events queue.
FAILED, WAITING = 400, 400


def poll(check: Callable[[], bool], timeout: float, what: str) -> None:
    """`wait_until`, looking every millisecond: the moment matters here."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.001)


@pytest.mark.slow
def test_a_dashboard_killed_during_requeue_all_and_compact_loses_no_job(
    settings: Settings, redis_conn: Redis, factory: Factory, tmp_path: Path
) -> None:
    """The operator presses "Compact" on a queue with a backlog, then "Requeue
    All" on a few hundred dead letters, and the dashboard is killed while the
    requeue runs: every job is still in the dead-letter queue or on the events
    queue, once, and nothing is left in a compaction list."""
    shop = factory.shop()
    queue = events_queue(redis_conn, settings)
    registry = FailedJobRegistry(queue=queue)
    failed = [
        enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings)
        for _ in range(FAILED)
    ]
    with redis_conn.pipeline() as pipe:
        for job in failed:
            pipe.hset(job.key, "retries_left", 0)
        pipe.execute()
    # No consumer runtime in this process: each job fails once, for good.
    PayhookWorker(
        [queue.name], connection=redis_conn, serializer=JSONSerializer, job_class=PayhookJob
    ).work(burst=True, logging_level="ERROR")
    assert sorted(registry.get_job_ids()) == sorted(job.id for job in failed)
    waiting = [
        enqueue_event(queue, factory.standard_envelope(shop, StandardEvent()), settings).id
        for _ in range(WAITING)
    ]
    every_job = sorted([job.id for job in failed] + waiting)

    port = free_port()
    env = process_env(settings, PAYHOOK_DASHBOARD_PASSWORD=PASSWORD)
    dashboard = start(["dashboard", "--port", str(port)], env, tmp_path / "dashboard.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(f"{base}/healthz"), 30, "the dashboard")
        page = httpx.get(f"{base}/", auth=(USER, PASSWORD), timeout=10)
        assert page.status_code == 200
        own_page = {
            CSRF_HEADER: page.cookies[CSRF_COOKIE],
            "Origin": base,
            "Sec-Fetch-Site": "same-origin",
        }
        with ThreadPoolExecutor(2) as pool:

            def press(path: str) -> Future[httpx.Response]:
                return pool.submit(
                    httpx.post,
                    f"{base}{path}",
                    auth=(USER, PASSWORD),
                    headers=own_page,
                    cookies=page.cookies,
                    timeout=60,
                )

            # Compact first, then requeue-all, killed as soon as its first
            # job moved: the kill lands in the middle of it.
            compact = press(f"/queue/{settings.queue}/compact")
            poll(
                lambda: compact.done() or bool(redis_conn.keys("rq:queue:_compact:*")),
                30,
                "compact to be answered or under way",
            )
            requeue_all = press(f"/requeue/{settings.queue}")
            poll(lambda: queue.count > WAITING, 30, "the first job to be requeued")
            stop(dashboard, signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):
                requeue_all.result()

        on_queue = queue.get_job_ids()
        dead_letters = registry.get_job_ids()
        lost = set(every_job) - set(on_queue) - set(dead_letters)
        assert not lost, f"{len(lost)} jobs neither queued nor in the dead-letter queue"
        assert sorted(on_queue + dead_letters) == every_job, "a job in two places"
        assert redis_conn.keys("rq:queue:_compact:*") == []
        assert 0 < len(dead_letters) < FAILED, "the kill did not land during the requeue"
        assert compact.result().status_code == 403
        assert "dashboard_action_refused" in (tmp_path / "dashboard.log").read_text()
    finally:
        stop(dashboard, signal.SIGKILL)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
