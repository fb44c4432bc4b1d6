"""Claims under a lease and fenced completions, against real PostgreSQL."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from outbox_worker import claims
from outbox_worker.claims import Claim, StaleClaim
from payhook.db import Row, connect
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, Factory, Shop

#: A lease no test outlives.
LONG_LEASE = 300.0


def add_rows(conn: psycopg.Connection[Row], shop: Shop, order_id: str, count: int) -> list[str]:
    return Factory(conn).outbox_rows(shop, order_id, count)


def row(conn: psycopg.Connection[Row], row_id: str) -> dict[str, Any]:
    return Factory(conn).outbox_row(row_id)


def reclaim_after_lease(conn: psycopg.Connection[Row], lease: float) -> Claim:
    """Claim again once the previous lease of `lease` seconds has run out."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        taken = claims.claim_due_rows(conn, 1, LONG_LEASE, TEST_KEYRING)
        if taken:
            return taken[0]
        time.sleep(lease)
    raise AssertionError("the row was never claimable again")


@pytest.fixture
def shop(factory: Factory) -> Shop:
    return factory.shop(fulfilment_url="http://127.0.0.1:9/fulfil")


@pytest.fixture
def order_id(factory: Factory, shop: Shop) -> str:
    return factory.order(shop)


def test_claim_leases_rows_with_fresh_tokens_and_counts_the_attempt(
    conn: psycopg.Connection[Row], shop: Shop, order_id: str
) -> None:
    ids = add_rows(conn, shop, order_id, 3)
    taken = claims.claim_due_rows(conn, 10, LONG_LEASE, TEST_KEYRING)
    assert sorted(c.id for c in taken) == sorted(ids)
    assert len({c.token for c in taken}) == 3
    for claim in taken:
        stored = row(conn, claim.id)
        assert str(stored["claim_token"]) == claim.token and stored["attempts"] == 1
        assert stored["claimed_until"] == stored["next_attempt_at"] == claim.claimed_until
        assert claim.fulfilment_url == "http://127.0.0.1:9/fulfil"
        assert claim.signing_secret is not None and claim.signing_secret.startswith("whsec_")
        assert claim.idempotency_key == f"{shop.tenant_id}:{claim.event_id}:fulfil_order"


def test_leased_row_is_not_claimed_again_while_the_lease_lasts(
    conn: psycopg.Connection[Row], shop: Shop, order_id: str
) -> None:
    add_rows(conn, shop, order_id, 2)
    assert len(claims.claim_due_rows(conn, 10, LONG_LEASE, TEST_KEYRING)) == 2
    assert claims.claim_due_rows(conn, 10, LONG_LEASE, TEST_KEYRING) == []


def test_claims_respect_the_batch_size(
    conn: psycopg.Connection[Row], shop: Shop, order_id: str
) -> None:
    add_rows(conn, shop, order_id, 5)
    assert len(claims.claim_due_rows(conn, 2, LONG_LEASE, TEST_KEYRING)) == 2
    assert len(claims.claim_due_rows(conn, 2, LONG_LEASE, TEST_KEYRING)) == 2
    assert len(claims.claim_due_rows(conn, 2, LONG_LEASE, TEST_KEYRING)) == 1


def test_concurrent_claims_skip_locked_rows_instead_of_sharing_them(
    conn: psycopg.Connection[Row], settings: Settings, shop: Shop, order_id: str
) -> None:
    """A claim still in flight holds its rows; a second claimer gets the others, at once."""
    add_rows(conn, shop, order_id, 6)
    with connect(settings, "test") as other:
        with conn.transaction():
            first = claims.claim_due_rows(conn, 3, LONG_LEASE, TEST_KEYRING)
            # Not committed yet: without SKIP LOCKED this would wait or overlap.
            other.execute("SET lock_timeout = '2s'")
            second = claims.claim_due_rows(other, 10, LONG_LEASE, TEST_KEYRING)
    assert len(first) == 3 and len(second) == 3
    assert not {c.id for c in first} & {c.id for c in second}


def test_row_is_claimable_again_after_its_lease_with_a_new_token(
    conn: psycopg.Connection[Row], shop: Shop, order_id: str
) -> None:
    add_rows(conn, shop, order_id, 1)
    [first] = claims.claim_due_rows(conn, 1, 0.2, TEST_KEYRING)
    second = reclaim_after_lease(conn, 0.2)
    assert second.id == first.id and second.token != first.token
    assert second.attempts == 2


def test_completion_with_a_stale_claim_token_is_rejected(
    conn: psycopg.Connection[Row], shop: Shop, order_id: str
) -> None:
    """The worker whose lease ran out cannot overwrite what the new holder records."""
    add_rows(conn, shop, order_id, 1)
    [stale] = claims.claim_due_rows(conn, 1, 0.2, TEST_KEYRING)
    current = reclaim_after_lease(conn, 0.2)

    with pytest.raises(StaleClaim):
        claims.mark_delivered(conn, stale)
    with pytest.raises(StaleClaim):
        claims.schedule_retry(conn, stale, 1.0, "HTTP 500")
    with pytest.raises(StaleClaim):
        claims.mark_dead(conn, stale, "HTTP 400")
    stored = row(conn, current.id)
    assert stored["state"] == "pending" and str(stored["claim_token"]) == current.token
    assert stored["last_error"] is None
    assert claims.release(conn, stale) is False

    claims.mark_delivered(conn, current)
    with pytest.raises(StaleClaim):
        claims.mark_dead(conn, stale, "HTTP 400")
    with pytest.raises(StaleClaim):
        claims.mark_delivered(conn, current)  # a completion is recorded once
    stored = row(conn, current.id)
    assert stored["state"] == "delivered" and stored["delivered_at"] is not None
    assert stored["claim_token"] is None


def test_retry_is_scheduled_after_the_delay_with_a_short_error(
    conn: psycopg.Connection[Row], shop: Shop, order_id: str
) -> None:
    add_rows(conn, shop, order_id, 1)
    [claim] = claims.claim_due_rows(conn, 1, LONG_LEASE, TEST_KEYRING)
    claims.schedule_retry(conn, claim, 120.0, "HTTP 503\n" + "x" * 1000)
    stored = row(conn, claim.id)
    assert stored["state"] == "pending" and stored["claim_token"] is None
    assert 110 < stored["due_in"].total_seconds() <= 120
    assert stored["last_error"].startswith("HTTP 503 xxx") and len(stored["last_error"]) == 300
    assert claims.claim_due_rows(conn, 1, LONG_LEASE, TEST_KEYRING) == []
    assert 110 < (claims.seconds_until_due(conn) or 0) <= 120


def test_dead_row_is_never_claimed(
    conn: psycopg.Connection[Row], shop: Shop, order_id: str
) -> None:
    add_rows(conn, shop, order_id, 1)
    [claim] = claims.claim_due_rows(conn, 1, 0.01, TEST_KEYRING)
    claims.mark_dead(conn, claim, "HTTP 400")
    time.sleep(0.05)
    assert claims.claim_due_rows(conn, 1, LONG_LEASE, TEST_KEYRING) == []
    assert claims.seconds_until_due(conn) is None
    assert row(conn, claim.id)["state"] == "dead"


def test_release_gives_the_row_back_due_now_without_counting_an_attempt(
    conn: psycopg.Connection[Row], shop: Shop, order_id: str
) -> None:
    add_rows(conn, shop, order_id, 1)
    [claim] = claims.claim_due_rows(conn, 1, LONG_LEASE, TEST_KEYRING)
    assert claims.release(conn, claim) is True
    stored = row(conn, claim.id)
    assert stored["attempts"] == 0 and stored["claim_token"] is None
    [again] = claims.claim_due_rows(conn, 1, LONG_LEASE, TEST_KEYRING)
    assert again.id == claim.id and again.attempts == 1


def test_row_of_a_vanished_tenant_is_claimed_without_url_or_secret(
    conn: psycopg.Connection[Row], shop: Shop, order_id: str
) -> None:
    [row_id] = add_rows(conn, shop, order_id, 1)
    other_tenant = str(uuid.uuid4())
    with conn.transaction():
        # Foreign keys forbid this; only a repair by hand could leave such a row.
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            "UPDATE payhook.payment_outbox SET tenant_id = %s WHERE id = %s",
            (other_tenant, row_id),
        )
    [claim] = claims.claim_due_rows(conn, 1, LONG_LEASE, TEST_KEYRING)
    assert claim.tenant_id == other_tenant
    assert claim.fulfilment_url is None and claim.signing_secret is None


def test_a_row_committed_while_a_claim_runs_is_returned_if_it_is_claimed(
    conn: psycopg.Connection[Row], settings: Settings, shop: Shop, order_id: str
) -> None:
    """The claim's statement starts; a row is committed; the claim's UPDATE,
    which waited for a lock, sees and claims it: it must be returned too, or
    no worker delivers it until its lease ends. (A SHARE ROW EXCLUSIVE lock
    held by the writer makes the claim's UPDATE wait at that point.)"""
    writer = connect(settings, "test", owner=True)
    claimed: list[Claim] = []
    try:
        writer.execute("BEGIN")
        writer.execute("LOCK TABLE payhook.payment_outbox IN SHARE ROW EXCLUSIVE MODE")
        with connect(settings, "outbox-worker") as claimer:
            pid = claimer.info.backend_pid
            thread = threading.Thread(
                target=lambda: claimed.extend(
                    claims.claim_due_rows(claimer, 10, LONG_LEASE, TEST_KEYRING)
                )
            )
            thread.start()
            deadline = time.monotonic() + 10
            while not _waits_for_a_lock(conn, pid):
                assert time.monotonic() < deadline, "the claim never waited for the lock"
                time.sleep(0.02)
            (new,) = Factory(writer).outbox_rows(shop, order_id, 1)
            writer.execute("COMMIT")
            thread.join(timeout=10)
    finally:
        writer.close()
    # The UPDATE took its snapshot once it had the lock: the row was claimed.
    assert row(conn, new)["attempts"] == 1
    assert [c.id for c in claimed] == [new], "claimed, but not returned to the worker"


def _waits_for_a_lock(conn: psycopg.Connection[Row], pid: int) -> bool:
    found = conn.execute(
        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return found is not None and found["wait_event_type"] == "Lock"
