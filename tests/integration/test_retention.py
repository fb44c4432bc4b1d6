"""Retention and the horizon guard against real PostgreSQL: no second effect, ever."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from consumer.handler import Runtime, handle
from control.operations import format_trace, trace_event
from control.retention import RetentionRun, retention_cutoffs, retention_seconds, run_retention
from payhook.db import Row, connect
from payhook.errors import SettingsError
from payhook.queries import query
from payhook.settings import Settings
from tests.conftest import test_settings
from tests.factories import Factory, Shop, StandardEvent, envelope, stripe_body, stripe_headers
from tests.processes import run_cli

DAY = 86400


def deliver(runtime: Runtime, factory: Factory, shop: Shop, event: StandardEvent) -> str:
    """One delivery of the event (a new delivery id each time, like a gateway retry)."""
    return handle(runtime, factory.standard_envelope(shop, event).to_json()).outcome


def age_receipts(conn: psycopg.Connection[Row], days: int, *event_ids: str) -> None:
    conn.execute(
        "UPDATE payhook.payment_event_receipts"
        " SET received_at = received_at - make_interval(days => %s)"
        " WHERE event_id = ANY(%s)",
        (days, list(event_ids)),
    )


def archived_ids(conn: psycopg.Connection[Row]) -> set[str]:
    rows = conn.execute("SELECT event_id FROM payhook.payment_event_receipts_archive").fetchall()
    return {r["event_id"] for r in rows}


def live_ids(conn: psycopg.Connection[Row]) -> set[str]:
    rows = conn.execute("SELECT event_id FROM payhook.payment_event_receipts").fetchall()
    return {r["event_id"] for r in rows}


def refunded(conn: psycopg.Connection[Row], order_id: str) -> int:
    row = conn.execute(
        "SELECT refunded_minor FROM payhook.payment_orders WHERE id = %s", (order_id,)
    ).fetchone()
    assert row is not None
    return int(row["refunded_minor"])


def test_receipts_past_the_horizon_move_to_a_compact_archive_in_batches(
    runtime: Runtime, factory: Factory, database: str
) -> None:
    shop = factory.shop()
    factory.order(shop)
    events = [StandardEvent(), StandardEvent(type="customer.updated"), StandardEvent()]
    assert [deliver(runtime, factory, shop, e) for e in events] == [
        "applied",
        "ignored",
        "already_applied",
    ]
    old, recent = events[:2], events[2]
    age_receipts(factory.conn, 401, *(e.event_id for e in old))
    before = {
        r["event_id"]: r
        for r in factory.conn.execute("SELECT * FROM payhook.payment_event_receipts").fetchall()
    }

    result = run_retention(factory.conn, test_settings(database, PAYHOOK_RETENTION_BATCH="1"))

    assert result.receipts_archived == 2
    assert result.batches >= 3, "one receipt per batch, then an empty batch"
    assert live_ids(factory.conn) == {recent.event_id}
    rows = factory.conn.execute(
        "SELECT * FROM payhook.payment_event_receipts_archive ORDER BY received_at"
    ).fetchall()
    assert [r["event_id"] for r in rows] == [e.event_id for e in old]
    for row in rows:
        live = before[row["event_id"]]
        assert bytes(row["payload_sha256"]).hex() == live["payload_sha256"]
        meaning = row["meaning_sha256"]
        assert (None if meaning is None else bytes(meaning).hex()) == live["meaning_sha256"]
        assert (row["outcome"], row["received_at"], row["processed_at"], row["occurred_at"]) == (
            live["outcome"],
            live["received_at"],
            live["processed_at"],
            live["occurred_at"],
        )
        assert set(row) == {
            "tenant_id",
            "event_id",
            "payload_sha256",
            "meaning_sha256",
            "outcome",
            "occurred_at",
            "received_at",
            "processed_at",
            "archived_at",
        }, "the archive keeps identity, digest, outcome and timestamps only"


def test_dry_run_counts_what_would_go_and_changes_nothing(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    """The dry run counts with its own statement: it must skip what the run skips."""
    shop = factory.shop()
    factory.order(shop)
    event = StandardEvent()
    deliver(runtime, factory, shop, event)
    # Old too, but its exception is open: it stays live, and is not counted.
    mismatch = StandardEvent(amount=5000, type="payment.refunded")  # over-refund
    deliver(runtime, factory, shop, mismatch)
    assert factory.count("payment_exceptions") == 1
    age_receipts(factory.conn, 500, event.event_id, mismatch.event_id)
    result = run_retention(factory.conn, settings, dry_run=True)
    assert (result.dry_run, result.receipts_archived) == (True, 1)
    assert live_ids(factory.conn) == {event.event_id, mismatch.event_id}
    assert archived_ids(factory.conn) == set()
    done = run_retention(factory.conn, settings)
    assert done.receipts_archived == result.receipts_archived
    assert archived_ids(factory.conn) == {event.event_id}


@pytest.mark.parametrize("dry_run", [True, False])
def test_horizons_shown_are_the_databases_clock(
    factory: Factory, settings: Settings, dry_run: bool
) -> None:
    """The statements compare with the database's `now()`; the horizons a run
    reports count from it too, not from the host's clock."""
    with factory.conn.transaction():
        # now() stands still for a transaction: the host's clock moves on.
        row = factory.conn.execute("SELECT now() AS now").fetchone()
        assert row is not None
        time.sleep(0.05)
        result = run_retention(factory.conn, settings, dry_run=dry_run)
    started = row["now"].astimezone(UTC)
    assert result.horizons == {
        name: (started - timedelta(seconds=seconds)).isoformat()
        for name, seconds in retention_seconds(settings).items()
    }
    assert result.horizons["receipts"] == (
        (started - timedelta(seconds=settings.receipt_retention)).isoformat()
    )


def test_archived_event_redelivered_is_a_duplicate_with_no_effect(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    payment = StandardEvent()
    refund = StandardEvent(type="payment.refunded", amount=500)
    assert deliver(runtime, factory, shop, payment) == "applied"
    assert deliver(runtime, factory, shop, refund) == "applied"
    age_receipts(factory.conn, 401, payment.event_id, refund.event_id)
    assert run_retention(factory.conn, settings).receipts_archived == 2

    assert deliver(runtime, factory, shop, refund) == "duplicate"
    assert deliver(runtime, factory, shop, payment) == "duplicate"

    assert live_ids(factory.conn) == set(), "no live receipt is created again"
    assert refunded(factory.conn, order_id) == 500
    assert factory.count("payment_order_transitions", order_id=order_id) == 2
    assert factory.count("payment_outbox", order_id=order_id) == 2
    assert factory.count("security_anomalies") == 0

    trace = trace_event(factory.conn, shop.tenant_id, payment.event_id)
    assert trace.receipt is not None and trace.receipt["archived_at"] is not None
    assert trace.receipt["outcome"] == "applied" and trace.receipt["payload_sha256"]
    assert [t["to_state"] for t in trace.transitions] == ["paid"]
    receipt_line = format_trace(trace).splitlines()[1]
    assert "archived=" in receipt_line and "outcome=applied" in receipt_line


def test_archived_event_redelivered_with_other_content_is_a_digest_conflict(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    first = StandardEvent(type="payment.failed")
    assert deliver(runtime, factory, shop, first) == "applied"
    age_receipts(factory.conn, 401, first.event_id)
    run_retention(factory.conn, settings)
    forged = StandardEvent(event_id=first.event_id)
    assert deliver(runtime, factory, shop, forged) == "digest_conflict"
    assert factory.order_state(shop, order_id) == "failed"
    assert factory.count("security_anomalies", kind="digest_conflict") == 1
    assert live_ids(factory.conn) == set()


@pytest.mark.parametrize("gateway", ["standard", "stripe"])
def test_event_beyond_the_horizon_is_refused_with_an_exception(
    runtime: Runtime, factory: Factory, gateway: str
) -> None:
    shop = factory.shop(gateway)
    order_id = factory.order(shop)
    occurred = int(time.time()) - 401 * DAY
    if gateway == "standard":
        job = factory.standard_envelope(shop, StandardEvent(timestamp=occurred)).to_json()
    else:
        body = json.loads(stripe_body())
        body["created"] = occurred
        raw = json.dumps(body).encode()
        job = envelope(shop, raw, stripe_headers(shop.secret, raw)).to_json()

    assert handle(runtime, job).outcome == "beyond_horizon"
    job["delivery_id"] = "6f1de7a8-8a39-4c38-9a6b-0f36a1d0f2a4"
    assert handle(runtime, job).outcome == "duplicate"

    assert factory.order_state(shop, order_id) == "pending"
    assert factory.count("payment_outbox") == 0
    assert factory.count("payment_order_transitions") == 0
    assert factory.count("payment_event_receipts", outcome="beyond_horizon") == 1
    exception = factory.conn.execute(
        "SELECT kind, detail, resolved_at FROM payhook.payment_exceptions"
    ).fetchall()
    assert len(exception) == 1 and exception[0]["kind"] == "beyond_horizon"
    assert exception[0]["resolved_at"] is None, "open, so it is seen and alerted on"
    detail = exception[0]["detail"]
    assert datetime.fromisoformat(detail["occurred_at"]) == datetime.fromtimestamp(occurred, UTC)
    assert datetime.fromisoformat(detail["horizon"]) > datetime.fromtimestamp(occurred, UTC)


def test_event_just_inside_the_horizon_is_applied(runtime: Runtime, factory: Factory) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent(timestamp=int(time.time()) - 399 * DAY)
    assert deliver(runtime, factory, shop, event) == "applied"
    assert factory.order_state(shop, order_id) == "paid"


def test_redelivery_waiting_on_a_retention_batch_sees_the_archive(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    """The redelivery's insert waits for the batch deleting its receipt, then must not apply.

    A partial refund is not idempotent by the order's state: applied twice it
    refunds twice. Only the receipt identity, live or archived, prevents it.
    """
    shop = factory.shop()
    order_id = factory.order(shop)
    refund = StandardEvent(type="payment.refunded", amount=500)
    assert deliver(runtime, factory, shop, StandardEvent()) == "applied"
    assert deliver(runtime, factory, shop, refund) == "applied"
    age_receipts(factory.conn, 401, refund.event_id)

    job = factory.standard_envelope(shop, refund).to_json()
    outcomes: list[str] = []
    with connect(settings, "retention") as batch_conn:
        with batch_conn.transaction():
            cutoff = retention_cutoffs(batch_conn, settings)["receipts"]
            moved = batch_conn.execute(
                query("archive_receipts"), {"cutoff": cutoff, "batch": 10}
            ).fetchone()
            assert moved is not None and moved["archived"] == 1
            redelivery = threading.Thread(
                target=lambda: outcomes.append(handle(runtime, job).outcome)
            )
            redelivery.start()
            wait_for_lock_wait(factory.conn, exclude_pid=batch_conn.info.backend_pid)
            assert redelivery.is_alive(), "the redelivery waits for the batch"
        redelivery.join(timeout=30)

    assert outcomes == ["duplicate"]
    assert refunded(factory.conn, order_id) == 500
    assert factory.count("payment_outbox", order_id=order_id, action="notify_refund") == 1
    assert refund.event_id in archived_ids(factory.conn)
    assert refund.event_id not in live_ids(factory.conn)


def wait_for_lock_wait(conn: psycopg.Connection[Row], exclude_pid: int) -> None:
    """Until another backend of this database waits for a lock."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT count(*) AS n FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> %s",
            (exclude_pid,),
        ).fetchone()
        if row is not None and row["n"] > 0:
            return
        time.sleep(0.02)
    raise AssertionError("no backend ever waited for the retention batch")


def test_retention_running_with_consumers_loses_nothing(
    runtime: Runtime, factory: Factory, database: str
) -> None:
    """Consumers redeliver old events and apply new ones while retention moves receipts."""
    shop = factory.shop()
    orders, payments = [], []
    for i in range(40):
        orders.append(factory.order(shop, f"order-{i}", f"pi_{i}", amount=2000))
        payments.append(
            StandardEvent(gateway_order_id=f"pi_{i}", merchant_reference=f"order-{i}", amount=2000)
        )
    assert {deliver(runtime, factory, shop, e) for e in payments} == {"applied"}
    age_receipts(factory.conn, 401, *(e.event_id for e in payments))
    refunds = [
        StandardEvent(
            type="payment.refunded",
            gateway_order_id=f"pi_{i}",
            merchant_reference=f"order-{i}",
            amount=700,
        )
        for i in range(40)
    ]
    jobs = [(e, "old") for e in payments] + [(e, "new") for e in refunds]
    jobs += [(e, "old") for e in payments]
    retention_settings = test_settings(database, PAYHOOK_RETENTION_BATCH="3")
    outcomes: Counter[tuple[str, str]] = Counter()
    errors: list[BaseException] = []
    done = threading.Event()

    def consume(part: list[tuple[StandardEvent, str]]) -> None:
        try:
            for event, age in part:
                outcomes[(age, deliver(runtime, factory, shop, event))] += 1
        except BaseException as exc:
            errors.append(exc)

    def retain() -> None:
        try:
            with connect(retention_settings, "retention") as conn:
                while not done.is_set():
                    run_retention(conn, retention_settings)
                run_retention(conn, retention_settings)
        except BaseException as exc:
            errors.append(exc)

    keeper = threading.Thread(target=retain)
    keeper.start()
    consumers = [threading.Thread(target=consume, args=(jobs[i::4],)) for i in range(4)]
    for t in consumers:
        t.start()
    for t in consumers:
        t.join(timeout=60)
    done.set()
    keeper.join(timeout=60)

    assert errors == []
    assert outcomes == {("old", "duplicate"): 80, ("new", "applied"): 40}
    archived, live = archived_ids(factory.conn), live_ids(factory.conn)
    assert archived == {e.event_id for e in payments}, "every old receipt archived"
    assert live == {e.event_id for e in refunds}, "every new receipt live, no old one revived"
    assert factory.count("payment_order_transitions") == 80
    assert factory.count("payment_outbox") == 80
    assert {refunded(factory.conn, o) for o in orders} == {700}


def test_delivered_outbox_resolved_exceptions_and_anomalies_follow_their_own_retention(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    for i in range(4):
        factory.order(shop, f"order-{i}", f"pi_{i}")
        deliver(
            runtime,
            factory,
            shop,
            StandardEvent(gateway_order_id=f"pi_{i}", merchant_reference=f"order-{i}"),
        )
    mismatches = [
        StandardEvent(
            gateway_order_id=f"pi_{i}",
            merchant_reference=f"order-{i}",
            amount=5000,
            type="payment.refunded",
        )
        for i in range(3)
    ]
    for event in mismatches:
        deliver(runtime, factory, shop, event)
    conn = factory.conn
    ids = [
        r["id"]
        for r in conn.execute(
            "SELECT id FROM payhook.payment_outbox ORDER BY created_at"
        ).fetchall()
    ]
    old = "now() - interval '31 days'"
    conn.execute(
        f"UPDATE payhook.payment_outbox SET state = 'delivered', delivered_at = {old}"
        " WHERE id = %s",
        (ids[0],),
    )
    conn.execute(
        "UPDATE payhook.payment_outbox SET state = 'delivered', delivered_at = now() WHERE id = %s",
        (ids[1],),
    )
    conn.execute(
        f"UPDATE payhook.payment_outbox SET state = 'dead', created_at = {old} WHERE id = %s",
        (ids[2],),
    )
    conn.execute(f"UPDATE payhook.payment_outbox SET created_at = {old} WHERE id = %s", (ids[3],))
    exc_ids = [
        r["id"]
        for r in conn.execute("SELECT id FROM payhook.payment_exceptions ORDER BY id").fetchall()
    ]
    conn.execute(
        "UPDATE payhook.payment_exceptions SET resolved_at = now() - interval '401 days'"
        " WHERE id = %s",
        (exc_ids[0],),
    )
    conn.execute(
        "UPDATE payhook.payment_exceptions SET resolved_at = now() - interval '10 days'"
        " WHERE id = %s",
        (exc_ids[1],),
    )
    conn.execute(
        "UPDATE payhook.payment_exceptions SET created_at = now() - interval '500 days'"
        " WHERE id = %s",
        (exc_ids[2],),
    )
    conn.execute(
        "INSERT INTO payhook.security_anomalies (kind, detected_at) VALUES"
        " ('signature_invalid', now() - interval '401 days'), ('signature_invalid', now())"
    )
    # The receipt of the still-open exception is old too: it must stay live.
    age_receipts(conn, 401, mismatches[2].event_id)

    result = run_retention(conn, settings)

    assert (result.outbox_deleted, result.exceptions_deleted, result.anomalies_deleted) == (1, 1, 1)
    assert sorted(
        r["id"] for r in conn.execute("SELECT id FROM payhook.payment_outbox").fetchall()
    ) == sorted(ids[1:])
    assert (
        sorted(
            r["id"] for r in conn.execute("SELECT id FROM payhook.payment_exceptions").fetchall()
        )
        == exc_ids[1:]
    )
    assert factory.count("security_anomalies") == 1
    assert mismatches[2].event_id in live_ids(conn), "an open exception keeps its receipt live"
    assert result.receipts_archived == 0


def test_retention_command_dry_run_then_run(
    runtime: Runtime, factory: Factory, database: str
) -> None:
    shop = factory.shop()
    factory.order(shop)
    event = StandardEvent()
    deliver(runtime, factory, shop, event)
    age_receipts(factory.conn, 38, event.event_id)

    dry = run_cli(
        test_settings(database), "retention", "run", "--dry-run", PAYHOOK_RECEIPT_RETENTION="37d"
    )
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["receipts_archived"] == 1
    assert live_ids(factory.conn) == {event.event_id}

    done = run_cli(test_settings(database), "retention", "run", PAYHOOK_RECEIPT_RETENTION="37d")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["receipts_archived"] == 1
    assert archived_ids(factory.conn) == {event.event_id}


def test_retention_command_refuses_a_retention_inside_the_redelivery_window(
    database: str,
) -> None:
    result = run_cli(test_settings(database), "retention", "run", PAYHOOK_RECEIPT_RETENTION="7d")
    assert result.returncode == 2
    assert "PAYHOOK_RECEIPT_RETENTION" in result.stderr and "37d" in result.stderr


def test_the_configured_retention_sets_the_horizon(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    """PAYHOOK_RECEIPT_RETENTION=40d: a 45-day-old event is refused, a 35-day-old one applied."""
    shorter = Runtime(
        settings=replace(settings, receipt_retention=40 * DAY),
        pool=runtime.pool,
        redis=runtime.redis,
    )
    shop = factory.shop()
    factory.order(shop)
    old = StandardEvent(timestamp=int(time.time()) - 45 * DAY)
    recent = StandardEvent(timestamp=int(time.time()) - 35 * DAY)
    assert (
        handle(shorter, factory.standard_envelope(shop, old).to_json()).outcome == "beyond_horizon"
    )
    assert handle(shorter, factory.standard_envelope(shop, recent).to_json()).outcome == "applied"


def test_anomalies_are_never_deleted_while_their_alert_is_due(
    factory: Factory, database: str
) -> None:
    """A digest conflict keeps its alert on for PAYHOOK_ALERT_WINDOW: a
    retention shorter than that would silence it, so the run refuses."""
    conn = factory.conn
    conn.execute(
        "INSERT INTO payhook.security_anomalies (kind, detected_at)"
        " VALUES ('digest_conflict', now() - interval '2 hours')"
    )
    short = test_settings(database, PAYHOOK_ANOMALY_RETENTION="1h")
    with pytest.raises(SettingsError, match=r"^PAYHOOK_ANOMALY_RETENTION: 1h is shorter than"):
        run_retention(conn, short)
    assert factory.count("security_anomalies") == 1
    cli = run_cli(short, "retention", "run", PAYHOOK_ANOMALY_RETENTION="1h")
    assert cli.returncode == 2 and "PAYHOOK_ALERT_WINDOW (1d)" in cli.stderr
    assert factory.count("security_anomalies") == 1

    narrow = test_settings(database, PAYHOOK_ANOMALY_RETENTION="1h", PAYHOOK_ALERT_WINDOW="30m")
    assert run_retention(conn, narrow).anomalies_deleted == 1


def test_every_batch_of_a_run_compares_with_the_horizons_it_reports(
    runtime: Runtime, factory: Factory, settings: Settings, database: str
) -> None:
    """The cutoffs are taken once, at the start of a run: a receipt that comes
    of age while a long run goes on is left for the next run, and the horizons
    printed are the ones every batch used."""
    shop = factory.shop()
    factory.order(shop)
    old, young = StandardEvent(), StandardEvent(type="customer.updated")
    assert deliver(runtime, factory, shop, old) == "applied"
    assert deliver(runtime, factory, shop, young) == "ignored"
    one_by_one = test_settings(database, PAYHOOK_RETENTION_BATCH="1")
    age_receipts(factory.conn, 500, old.event_id)
    # One second short of the horizon when the run starts; past it a second later.
    factory.conn.execute(
        "UPDATE payhook.payment_event_receipts"
        " SET received_at = now() - make_interval(secs => %s) + interval '1 second'"
        " WHERE event_id = %s",
        (one_by_one.receipt_retention, young.event_id),
    )
    results: list[RetentionRun] = []
    with (
        connect(settings, "test", owner=True) as blocker,
        connect(settings, "retention") as retention,
    ):
        # The first batch, archiving `old`, waits for this uncommitted insert
        # of the same identity: the run's later batches start 2 s later.
        blocker.execute("BEGIN")
        blocker.execute(
            "INSERT INTO payhook.payment_event_receipts_archive"
            " (tenant_id, event_id, payload_sha256, outcome, received_at)"
            " VALUES (%s, %s, sha256(''::bytea), 'applied', now())",
            (shop.tenant_id, old.event_id),
        )
        run = threading.Thread(
            target=lambda: results.append(run_retention(retention, one_by_one)), daemon=True
        )
        run.start()
        try:
            wait_for_lock_wait(factory.conn, exclude_pid=blocker.info.backend_pid)
            time.sleep(2)
        finally:
            blocker.execute("ROLLBACK")
            run.join(timeout=30)

    [result] = results
    horizon = datetime.fromisoformat(result.horizons["receipts"])
    assert result.receipts_archived == 1
    assert archived_ids(factory.conn) == {old.event_id}
    assert live_ids(factory.conn) == {young.event_id}, "it came of age after the run began"
    row = factory.conn.execute(
        "SELECT received_at FROM payhook.payment_event_receipts WHERE event_id = %s",
        (young.event_id,),
    ).fetchone()
    assert row is not None and row["received_at"] >= horizon


@pytest.mark.parametrize(
    "name",
    [
        "PAYHOOK_RECEIPT_RETENTION",
        "PAYHOOK_OUTBOX_RETENTION",
        "PAYHOOK_EXCEPTION_RETENTION",
        "PAYHOOK_ANOMALY_RETENTION",
        "PAYHOOK_ALERT_WINDOW",
    ],
)
def test_a_retention_beyond_a_century_stops_the_run_at_start_by_name(
    factory: Factory, database: str, name: str
) -> None:
    """A few million days reach past what Python's and PostgreSQL's calendars
    hold: every job, run and alert read would fail. Refused before any of them."""
    factory.shop()
    result = run_cli(test_settings(database), "retention", "run", **{name: "3000000d"})
    assert result.returncode == 2
    assert f"{name}: expected at most 36500d (100 years), got '3000000d'" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_longest_retentions_allowed_work_in_the_consumer_and_in_a_run(
    runtime: Runtime, factory: Factory, database: str
) -> None:
    longest = test_settings(
        database,
        **{
            name: "36500d"
            for name in (
                "PAYHOOK_RECEIPT_RETENTION",
                "PAYHOOK_OUTBOX_RETENTION",
                "PAYHOOK_EXCEPTION_RETENTION",
                "PAYHOOK_ANOMALY_RETENTION",
                "PAYHOOK_ALERT_WINDOW",
            )
        },
    )
    keeping = Runtime(settings=longest, pool=runtime.pool, redis=runtime.redis)
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent()
    payload = json.loads(event.body())
    payload["timestamp"] = (datetime.now(UTC) - timedelta(days=36000)).isoformat()
    body = json.dumps(payload).encode()
    job = envelope(shop, body, event.headers(shop.secret, body)).to_json()
    assert handle(keeping, job).outcome == "applied"
    assert factory.order_state(shop, order_id) == "paid"
    # A second event, applied now, its receipt then made older than the retention.
    past = StandardEvent(gateway_order_id="pi_past", merchant_reference="ref_past")
    factory.order(shop, merchant_reference="ref_past", gateway_order_id="pi_past")
    assert handle(keeping, factory.standard_envelope(shop, past).to_json()).outcome == "applied"
    age_receipts(factory.conn, 36000, event.event_id)
    age_receipts(factory.conn, 36600, past.event_id)
    for dry_run in (True, False):
        assert run_retention(factory.conn, longest, dry_run=dry_run).receipts_archived == 1
    assert live_ids(factory.conn) == {event.event_id}
    assert archived_ids(factory.conn) == {past.event_id}
