"""The operators' audit trail: every operator action writes a row no one can
change or remove, and the trace of an event shows what operators did about it."""

from __future__ import annotations

import io
import json
from typing import Any

import psycopg
import pytest
from redis import Redis
from rq.registry import FailedJobRegistry

from control import admin, audit, operations, outbox_admin
from control.cli import build_parser
from control.dashboard import create_app
from payhook.db import Row, connect
from payhook.errors import PayhookError
from payhook.queue import events_queue
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, Factory, StandardEvent
from tests.integration.test_dashboard_app import PASSWORD, USER, own_page, token
from tests.integration.test_ops_commands import deliver


def rows(conn: psycopg.Connection[Row], **where: Any) -> list[Row]:
    clause = " AND ".join(f"{k} = %({k})s" for k in where) or "true"
    return conn.execute(
        f"SELECT * FROM payhook.operator_actions WHERE {clause} ORDER BY id", where
    ).fetchall()


def run(settings: Settings, *argv: str) -> tuple[int, str]:
    args = build_parser().parse_args(list(argv))
    out = io.StringIO()
    return operations.run(args, settings, out=out), out.getvalue()


def test_resolving_by_hand_is_kept_with_its_note_and_shown_on_the_trace(
    conn: psycopg.Connection[Row],
    factory: Factory,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAYHOOK_OPERATOR", "ann@payments")
    shop = factory.shop()
    event = StandardEvent(merchant_reference="nope", gateway_order_id="pi_x")
    assert deliver(conn, shop, event) == "unmapped_order"
    (exception,) = conn.execute("SELECT id FROM payhook.payment_exceptions").fetchall()
    note = "customer paid by bank transfer, order 9"
    assert run(settings, "exceptions", "replay", str(exception["id"]), "--dry-run")[0] == 1
    assert run(settings, "exceptions", "resolve", str(exception["id"]), "--note", note)[0] == 0
    dry, resolved = rows(conn, tenant_id=shop.tenant_id)
    assert (dry["action"], dry["actor"], dry["source"]) == (
        "exception_dry_run",
        "ann@payments",
        "cli",
    )
    assert (resolved["action"], resolved["note"], resolved["event_id"]) == (
        "exception_resolve", note, event.event_id,
    )  # fmt: skip
    assert resolved["result"] == {"changed": True}
    trace = operations.trace_event(conn, shop.tenant_id, event.event_id)
    text = operations.format_trace(trace)
    assert "operator    exception_resolve exception" in text and note in text
    assert [a["action"] for a in audit.actions(conn, shop.tenant_id, event.event_id)] == [
        "exception_resolve",
        "exception_dry_run",
    ]


def test_no_role_can_change_or_remove_an_action(
    conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    audit.record(conn, "order_add", "order", "o1", tenant_id=shop.tenant_id, actor="ann")
    with connect(settings, "test") as app:  # payhook_app: never granted
        for statement in (
            "UPDATE payhook.operator_actions SET note = 'rewritten'",
            "DELETE FROM payhook.operator_actions",
            "TRUNCATE payhook.operator_actions",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute(statement)
    for statement in (  # the owner, past every grant: the trigger refuses
        "UPDATE payhook.operator_actions SET note = 'rewritten'",
        "DELETE FROM payhook.operator_actions",
        "TRUNCATE payhook.operator_actions",
    ):
        with pytest.raises(psycopg.Error, match="append-only") as refused:
            with conn.transaction():
                conn.execute(statement)
        assert refused.value.sqlstate == "PH003"
    assert [r["note"] for r in rows(conn)] == [None]


def test_outbox_endpoint_and_dead_letter_actions_are_kept(
    conn: psycopg.Connection[Row],
    factory: Factory,
    settings: Settings,
    redis_conn: Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shop = factory.shop()
    order = factory.order(shop)
    (row_id,) = factory.outbox_rows(shop, order, 1)
    conn.execute("UPDATE payhook.payment_outbox SET state = 'dead' WHERE id = %s", (row_id,))
    args = build_parser().parse_args(["outbox", "retry", row_id])
    assert outbox_admin.run(args, settings) == 0
    args = build_parser().parse_args(["endpoints", "rotate", shop.endpoint_id])
    assert args.func(args, settings) == 0
    secret = capsys.readouterr().out
    retry, rotate = rows(conn, tenant_id=shop.tenant_id)
    assert (retry["action"], retry["object_id"]) == ("outbox_retry", row_id)
    assert retry["event_id"] is not None
    assert (rotate["action"], rotate["object_kind"]) == ("endpoint_rotate", "endpoint")
    assert "whsec_" not in str(rotate) and secret.strip() not in str(rotate)

    # Dead letters, requeued from the command line and from the dashboard.
    queue = events_queue(redis_conn, settings)
    failed = FailedJobRegistry(queue=queue)
    for _ in range(2):
        job = queue.enqueue("consumer.jobs.apply_event", factory.standard_envelope(
            shop, StandardEvent()).to_json())  # fmt: skip
        queue.remove(job)
        failed.add(job, ttl=600, exc_string="boom")
    first, second = failed.get_job_ids()
    assert run(settings, "dlq", "requeue", first)[0] == 0
    client = create_app(settings, USER, PASSWORD).test_client()
    answer = client.post(f"/job/{second}/requeue", headers=own_page(token(client)))
    assert answer.status_code == 200, answer.get_data(as_text=True)
    requeues = rows(conn, action="dlq_requeue")
    assert [(r["object_id"], r["source"], r["tenant_id"]) for r in requeues] == [
        (first, "cli", None),
        (second, "dashboard", None),
    ]
    assert requeues[1]["actor"] == USER


def test_adding_tenants_endpoints_and_orders_is_kept(
    conn: psycopg.Connection[Row], settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    tenant = admin.add_tenant(conn, "audited", keyring=TEST_KEYRING)
    args = build_parser().parse_args(
        ["endpoints", "add", "--tenant", tenant, "--gateway", "stripe"]
    )
    assert args.func(args, settings) == 0
    args = build_parser().parse_args(
        ["orders", "add", "--tenant", tenant, "--merchant-ref", "r1", "--gateway-order-id", "pi_1",
         "--amount", "100", "--currency", "EUR"]
    )  # fmt: skip
    assert args.func(args, settings) == 0
    assert [r["action"] for r in rows(conn, tenant_id=tenant)] == ["endpoint_add", "order_add"]


def test_payhook_audit_lists_a_tenants_actions(
    conn: psycopg.Connection[Row],
    factory: Factory,
    settings: Settings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shop, other = factory.shop(), factory.shop()
    audit.record(conn, "order_add", "order", "o1", tenant_id=shop.tenant_id, actor="ann")
    audit.record(conn, "order_add", "order", "o2", tenant_id=other.tenant_id, actor="bob")
    audit.record(conn, "outbox_retry", "outbox", "x", tenant_id=shop.tenant_id, event_id="evt_1")
    args = build_parser().parse_args(["audit", "--tenant", shop.tenant_id])
    assert args.func(args, settings) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["action"], r["object_id"]) for r in listed] == [
        ("outbox_retry", "x"),
        ("order_add", "o1"),
    ]
    args = build_parser().parse_args(["audit", "--tenant", shop.tenant_id, "--event-id", "evt_1"])
    assert args.func(args, settings) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    for bad, message in (
        (["--tenant", "bogus"], "expected a UUID"),
        (["--tenant", shop.tenant_id, "--limit", "0"], "--limit"),
    ):
        args = build_parser().parse_args(["audit", *bad])
        with pytest.raises(PayhookError, match=message):
            args.func(args, settings)
