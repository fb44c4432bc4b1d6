"""payhook behind PgBouncer in transaction mode: every process's DATABASE_URL
goes through a real PgBouncer (Debian's), migrations and the outbox worker's
LISTEN take the direct URL, and the scenarios that guard the promise pass
unchanged: the duplicate storm, the consumer killed after its commit, the
fulfilments delivered by the outbox worker with and without LISTEN, and the
outbox worker tests (tests/e2e/test_outbox_workers.py), each run here with
its workers behind a PgBouncer in front of the suite's PostgreSQL."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.conftest import PG_SERVER
from tests.e2e.stack import PgBouncer, Stack, running_stack
from tests.e2e.test_outbox_workers import (
    receiver,
    test_idle_worker_wakes_on_the_commit_notification_not_the_poll,
    test_once_delivers_what_is_due_and_exits,
    test_rows_are_retried_while_the_receiver_is_down_and_delivered_when_it_returns,
    test_sigkilled_worker_rows_are_taken_over_after_the_lease,
    test_sigterm_finishes_the_delivery_in_flight_releases_the_rest_and_exits,
    test_three_workers_deliver_500_rows_each_exactly_once,
    test_worker_survives_its_database_connections_being_terminated,
    workers,
)
from tests.e2e.test_scenarios import (
    assert_one_effect,
    fulfil_key,
    send,
    test_consumer_killed_after_commit_then_redelivery_has_one_effect,
    test_duplicate_storm_across_two_ingresses_has_one_effect,
)
from tests.factories import StandardEvent
from tests.processes import stop, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("pgbouncer")]

# The outbox worker tests, and their fixtures, collected here again.
__all__ = [
    "receiver",
    "test_consumer_killed_after_commit_then_redelivery_has_one_effect",
    "test_duplicate_storm_across_two_ingresses_has_one_effect",
    "test_idle_worker_wakes_on_the_commit_notification_not_the_poll",
    "test_once_delivers_what_is_due_and_exits",
    "test_rows_are_retried_while_the_receiver_is_down_and_delivered_when_it_returns",
    "test_sigkilled_worker_rows_are_taken_over_after_the_lease",
    "test_sigterm_finishes_the_delivery_in_flight_releases_the_rest_and_exits",
    "test_three_workers_deliver_500_rows_each_exactly_once",
    "test_worker_survives_its_database_connections_being_terminated",
    "workers",
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(pooled=True) as running:
        yield running


@pytest.fixture(scope="module")
def suite_pgbouncer() -> Iterator[PgBouncer]:
    """A PgBouncer in front of the suite's PostgreSQL, for the outbox worker tests."""
    root = Path(tempfile.mkdtemp(prefix="payhook-pgbouncer-", dir="/tmp"))
    root.chmod(0o755)
    upstream = conninfo_to_dict(PG_SERVER)
    pooler = PgBouncer(root, int(upstream.get("port") or 5432))
    pooler.create_user(f"{PG_SERVER}/postgres")
    pooler.start()
    try:
        yield pooler
    finally:
        pooler.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def worker_env(suite_pgbouncer: PgBouncer) -> Callable[[str], dict[str, str]]:
    """The outbox workers' DATABASE_URL through PgBouncer; LISTEN on the direct URL."""

    def env(database: str) -> dict[str, str]:
        return {
            "DATABASE_URL": suite_pgbouncer.url(database),
            "PAYHOOK_DATABASE_POOLER": "transaction",
            "PAYHOOK_DATABASE_ROLE": "",
            "PAYHOOK_DATABASE_DIRECT_URL": f"{PG_SERVER}/{database}",
        }

    return env


def test_the_processes_reach_postgresql_only_through_pgbouncer(stack: Stack) -> None:
    shop = stack.shop()
    stack.order(shop, "pooled-1", "pi_pooled")
    event = StandardEvent(merchant_reference="pooled-1", gateway_order_id="pi_pooled")
    assert send(stack.url(shop), event, shop.secret) == 202
    stack.settle(timeout=30)
    assert_one_effect(stack, shop, event)
    with stack.db() as conn:
        sessions = conn.execute(
            "SELECT usename, application_name FROM pg_stat_activity"
            " WHERE application_name LIKE 'payhook-%%' AND pid <> pg_backend_pid()"
        ).fetchall()
    by_user = {(r["usename"], r["application_name"]) for r in sessions}
    # PgBouncer's server sessions log in as the pooled user; only the
    # outbox worker's LISTEN (and this test's owner connection) go direct.
    direct = {app for user, app in by_user if user != PgBouncer.USER}
    assert direct <= {"payhook-outbox-listen", "payhook-test"}, by_user
    assert {app for user, app in by_user if user == PgBouncer.USER}, by_user


def test_without_a_direct_url_the_outbox_worker_polls_and_delivers(stack: Stack) -> None:
    for proc in list(stack.outbox):
        stop(proc)
    stack.outbox.clear()
    stack.start_outbox_worker(PAYHOOK_DATABASE_DIRECT_URL="")
    shop = stack.shop()
    stack.order(shop, "polled-1", "pi_polled")
    event = StandardEvent(merchant_reference="polled-1", gateway_order_id="pi_polled")
    assert send(stack.url(shop), event, shop.secret) == 202
    stack.settle(timeout=30)
    wait_until(lambda: fulfil_key(shop, event) in stack.receiver.keys(), 10, "the fulfilment")
    assert_one_effect(stack, shop, event)
    logs = "".join(p.read_text() for p in stack.logs.glob("outbox-*.log"))
    assert "outbox_listen_off" in logs
