"""payhook behind PgBouncer in transaction mode: every process's DATABASE_URL
goes through a real PgBouncer (Debian's), migrations and the outbox worker's
LISTEN take the direct URL, and the scenarios that guard the promise pass
unchanged: the duplicate storm, the consumer killed after its commit, and
the fulfilments delivered by the outbox worker, with and without LISTEN."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.stack import PgBouncer, Stack, running_stack
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

__all__ = [
    "test_consumer_killed_after_commit_then_redelivery_has_one_effect",
    "test_duplicate_storm_across_two_ingresses_has_one_effect",
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(pooled=True) as running:
        yield running


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
