"""`payhook outbox list|retry|retry-dead`, as an operator runs them."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from control import outbox_admin
from control.cli import build_parser
from outbox_worker import claims
from payhook.db import Row, connect
from payhook.errors import NotFound, PayhookError
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, Factory


def command(settings: Settings, capsys: pytest.CaptureFixture[str], *argv: str) -> list[Row]:
    args = build_parser().parse_args(["outbox", *argv])
    assert args.func(args, settings) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.fixture
def rows(conn: psycopg.Connection[Row], factory: Factory) -> dict[str, str]:
    """One row in each state: pending, delivered, dead, and a second dead one."""
    shop = factory.shop(fulfilment_url="http://127.0.0.1:9/fulfil")
    order_id = factory.order(shop)
    made = {}
    for name in ("delivered", "dead", "dead2", "pending"):
        [made[name]] = factory.outbox_rows(shop, order_id, name=f"{name}_")
        if name != "pending":
            [claim] = claims.claim_due_rows(conn, 1, 60, TEST_KEYRING)
            if name == "delivered":
                claims.mark_delivered(conn, claim)
            else:
                claims.mark_dead(conn, claim, "HTTP 400")
    return made


def state(conn: psycopg.Connection[Row], row_id: str) -> Row:
    found = conn.execute(
        "SELECT state, attempts, last_error, next_attempt_at <= now() AS due"
        " FROM payhook.payment_outbox WHERE id = %s",
        (row_id,),
    ).fetchone()
    assert found is not None
    return found


def test_list_prints_json_lines_filtered_by_state(
    settings: Settings, rows: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    listed = command(settings, capsys, "list", "--state", "dead")
    assert sorted(r["id"] for r in listed) == sorted([rows["dead"], rows["dead2"]])
    assert {(r["state"], r["attempts"], r["last_error"]) for r in listed} == {
        ("dead", 1, "HTTP 400")
    }
    everything = command(settings, capsys, "list")
    assert {r["id"] for r in everything} == set(rows.values())
    assert len(command(settings, capsys, "list", "--limit", "2")) == 2


def test_retry_makes_a_dead_row_due_with_a_fresh_attempt_count(
    settings: Settings,
    conn: psycopg.Connection[Row],
    rows: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    with connect(settings, "test") as listener:
        listener.execute("LISTEN payhook_outbox")
        [answer] = command(settings, capsys, "retry", rows["dead"])
        woken = list(listener.notifies(timeout=5, stop_after=1))
    assert answer["id"] == rows["dead"] and answer["retried"] is True
    assert woken, "the workers are woken"
    retried = state(conn, rows["dead"])
    assert (retried["state"], retried["attempts"], retried["due"]) == ("pending", 0, True)
    assert retried["last_error"] == "HTTP 400", "the last error stays for the record"
    assert state(conn, rows["dead2"])["state"] == "dead"


def test_retry_refuses_delivered_in_flight_and_unknown_rows(
    settings: Settings, conn: psycopg.Connection[Row], rows: dict[str, str]
) -> None:
    with pytest.raises(outbox_admin.NotRetryable, match="already delivered"):
        outbox_admin.retry_row(conn, rows["delivered"])
    claims.claim_due_rows(conn, 1, 60, TEST_KEYRING)  # a worker holds the pending row
    with pytest.raises(outbox_admin.NotRetryable, match="right now"):
        outbox_admin.retry_row(conn, rows["pending"])
    with pytest.raises(NotFound):
        outbox_admin.retry_row(conn, str(uuid.uuid4()))
    with pytest.raises(PayhookError, match="UUID"):
        outbox_admin.retry_row(conn, "not-an-id")
    assert state(conn, rows["delivered"])["state"] == "delivered"


def test_retry_dead_retries_every_dead_row_and_nothing_else(
    settings: Settings,
    conn: psycopg.Connection[Row],
    rows: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert command(settings, capsys, "retry-dead") == [{"retried": 2}]
    assert {state(conn, rows[n])["state"] for n in ("dead", "dead2", "pending")} == {"pending"}
    assert state(conn, rows["delivered"])["state"] == "delivered"
    assert command(settings, capsys, "retry-dead") == [{"retried": 0}]
