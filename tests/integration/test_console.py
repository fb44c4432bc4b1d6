"""The operators' console: its pages read every tenant's state a page at a
time on an index, its actions are the commands' own, each audited, and
nothing secret or forged reaches a page."""

from __future__ import annotations

import html
import re
import time
import uuid
from urllib.parse import parse_qsl, urlsplit

import psycopg
import pytest
from flask.testing import FlaskClient
from redis import Redis

from control.dashboard import CSRF_COOKIE, create_app
from payhook import quarantine
from payhook.db import Row
from payhook.settings import Settings
from tests.factories import Factory, Shop, StandardEvent
from tests.integration.test_dashboard_app import AUTH, HOST, PASSWORD, USER
from tests.integration.test_ops_commands import deliver


@pytest.fixture
def client(settings: Settings) -> FlaskClient:
    return create_app(settings, USER, PASSWORD).test_client()


def get(client: FlaskClient, path: str, status: int = 200, /, **query: str) -> str:
    response = client.get(path, headers=AUTH, query_string=query)
    assert response.status_code == status, response.get_data(as_text=True)
    return response.get_data(as_text=True)


def csrf(client: FlaskClient, shop: Shop, event: StandardEvent) -> str:
    """The token the trace page's forms carry, as a browser gets it."""
    page = get(client, "/console/trace", tenant=shop.tenant_id, event=event.event_id)
    cookie = client.get_cookie(CSRF_COOKIE)
    assert cookie is not None
    assert f'name="_csrf_token" value="{cookie.value}"' in page
    return cookie.value


def post(client: FlaskClient, path: str, token: str | None, status: int = 200, **form: str) -> str:
    data = form | ({"_csrf_token": token} if token is not None else {})
    headers = AUTH | {"Origin": f"http://{HOST}", "Sec-Fetch-Site": "same-origin"}
    response = client.post(path, headers=headers, data=data)
    assert response.status_code == status, response.get_data(as_text=True)
    return response.get_data(as_text=True)


def mismatched(factory: Factory, conn: psycopg.Connection[Row]) -> tuple[Shop, str, StandardEvent]:
    """A tenant whose order says 1999 and whose gateway charged 2500."""
    shop = factory.shop()
    order_id = factory.order(shop, amount=1999)
    event = StandardEvent(amount=2500)
    assert deliver(conn, shop, event) == "amount_mismatch"
    return shop, order_id, event


def actions(conn: psycopg.Connection[Row]) -> list[Row]:
    return conn.execute(
        "SELECT actor, source, action, object_kind, object_id, note, event_id "
        "FROM payhook.operator_actions ORDER BY id"
    ).fetchall()


PAGES = ("exceptions", "anomalies", "outbox", "orders", "reconcile")


def exception_of(conn: psycopg.Connection[Row], event: StandardEvent) -> int:
    row = conn.execute(
        "SELECT id FROM payhook.payment_exceptions WHERE event_id = %s", (event.event_id,)
    ).fetchone()
    assert row is not None
    return int(row["id"])


def effects(conn: psycopg.Connection[Row], event: StandardEvent) -> tuple[int, int]:
    """Transitions and outbox rows of one event."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM payhook.payment_order_transitions WHERE event_id = %(e)s)"
        " AS transitions,"
        " (SELECT count(*) FROM payhook.payment_outbox WHERE event_id = %(e)s) AS outbox",
        {"e": event.event_id},
    ).fetchone()
    assert row is not None
    return int(row["transitions"]), int(row["outbox"])


def test_every_page_and_action_needs_the_credentials(client: FlaskClient) -> None:
    for name in (*PAGES, "trace"):
        assert client.get(f"/console/{name}").status_code == 401
    for path in ("/console/exceptions/1/replay", "/console/outbox/x/redeliver"):
        assert client.post(path).status_code == 401
    assert client.get("/console/", headers=AUTH).status_code == 302
    # One login: the queues' pages link to the console.
    assert 'href="/console/exceptions"' in get(client, "/")


def test_a_mismatched_event_is_dry_run_fixed_and_replayed_from_the_console(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop, order_id, event = mismatched(factory, conn)
    exception_id = exception_of(conn, event)
    assert event.event_id in get(client, "/console/exceptions", kind="amount_mismatch")
    token = csrf(client, shop, event)

    page = post(client, f"/console/exceptions/{exception_id}/dry-run", token)
    assert "Nothing was written" in page and "amount_mismatch" in page
    assert effects(conn, event) == (0, 0)
    assert factory.order_state(shop, order_id) == "pending"

    # The merchant's system corrects the order it had wrong.
    conn.execute("UPDATE payhook.payment_orders SET amount_minor = 2500 WHERE id = %s", (order_id,))
    page = post(client, f"/console/exceptions/{exception_id}/dry-run", token)
    assert "would decide" in page and "applied" in page and "pending → paid" in page
    assert "Replay now" in page
    assert effects(conn, event) == (0, 0)

    page = post(client, f"/console/exceptions/{exception_id}/replay", token)
    assert "Decided and written" in page and "pending → paid" in page
    assert effects(conn, event) == (1, 1)
    assert factory.order_state(shop, order_id) == "paid"
    # A second replay finds it resolved and writes nothing more.
    post(client, f"/console/exceptions/{exception_id}/replay", token)
    assert effects(conn, event) == (1, 1)

    trace = get(client, "/console/trace", tenant=shop.tenant_id, event=event.event_id)
    assert "pending → paid" in trace and "fulfil_order" in trace
    assert [(a["actor"], a["source"], a["action"]) for a in actions(conn)] == [
        (USER, "dashboard", "exception_dry_run"),
        (USER, "dashboard", "exception_dry_run"),
        (USER, "dashboard", "exception_replay"),
        (USER, "dashboard", "exception_replay"),
    ]
    assert trace.count("by operator (dashboard)") == 4
    assert event.event_id not in get(client, "/console/exceptions")
    assert event.event_id in get(client, "/console/exceptions", state="resolved")


def test_closing_by_hand_needs_a_note_and_keeps_it(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop, _, event = mismatched(factory, conn)
    exception_id = exception_of(conn, event)
    token = csrf(client, shop, event)
    path = f"/console/exceptions/{exception_id}/resolve"
    assert "needs a note" in post(client, path, token, status=400, note="  ")
    assert "at most 2000" in post(client, path, token, status=400, note="x" * 2001)
    assert actions(conn) == []
    note = "refunded the difference by hand, ticket 42"
    assert "is closed" in post(client, path, token, note=note)
    row = conn.execute(
        "SELECT resolved_at FROM payhook.payment_exceptions WHERE id = %s", (exception_id,)
    ).fetchone()
    assert row is not None and row["resolved_at"] is not None
    assert "already closed" in post(client, path, token, note=note)
    first, again = actions(conn)
    assert (first["action"], first["note"], first["event_id"], first["source"]) == (
        "exception_resolve", note, event.event_id, "dashboard",
    )  # fmt: skip
    assert again["note"] == note
    assert html.escape(note) in get(
        client, "/console/trace", tenant=shop.tenant_id, event=event.event_id
    )
    assert effects(conn, event) == (0, 0)


def test_a_dead_outbox_row_is_listed_and_redelivered(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    dead, delivered = factory.outbox_rows(shop, order_id, 2)
    conn.execute(
        "UPDATE payhook.payment_outbox SET state = 'dead', attempts = 12,"
        " last_error = 'HTTP 503 from the receiver' WHERE id = %s",
        (dead,),
    )
    conn.execute(
        "UPDATE payhook.payment_outbox SET state = 'delivered', delivered_at = now() WHERE id = %s",
        (delivered,),
    )
    page = get(client, "/console/outbox")
    assert dead in page and "HTTP 503 from the receiver" in page and delivered not in page
    token = client.get_cookie(CSRF_COOKIE)
    assert token is not None
    assert "is due now" in post(client, f"/console/outbox/{dead}/redeliver", token.value)
    row = conn.execute(
        "SELECT state, attempts FROM payhook.payment_outbox WHERE id = %s", (dead,)
    ).fetchone()
    assert row == {"state": "pending", "attempts": 0}
    assert "already delivered" in post(
        client, f"/console/outbox/{delivered}/redeliver", token.value, status=409
    )
    post(client, f"/console/outbox/{uuid.uuid4()}/redeliver", token.value, status=404)
    post(client, "/console/outbox/not-a-row/redeliver", token.value, status=409)
    assert [(a["action"], a["object_id"], a["source"]) for a in actions(conn)] == [
        ("outbox_retry", dead, "dashboard")
    ]


def test_overdue_outbox_rows_are_those_pending_past_the_sla(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    late, fresh = factory.outbox_rows(shop, order_id, 2)
    conn.execute(
        "UPDATE payhook.payment_outbox SET created_at = now() - interval '1 hour' WHERE id = %s",
        (late,),
    )
    page = get(client, "/console/outbox", view="overdue")
    assert late in page and fresh not in page


def test_forged_or_misdirected_actions_change_nothing(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop, _, event = mismatched(factory, conn)
    conn.execute("UPDATE payhook.payment_orders SET amount_minor = 2500")
    exception_id = exception_of(conn, event)
    token = csrf(client, shop, event)
    path = f"/console/exceptions/{exception_id}/replay"
    post(client, path, None, status=403)
    post(client, path, "not-the-token", status=403)
    assert client.get(path, headers=AUTH).status_code == 405
    cross_site = AUTH | {"Sec-Fetch-Site": "cross-site"}
    assert client.post(path, headers=cross_site, data={"_csrf_token": token}).status_code == 403
    other_origin = AUTH | {"Origin": "https://evil.example"}
    assert client.post(path, headers=other_origin, data={"_csrf_token": token}).status_code == 403
    assert effects(conn, event) == (0, 0)
    assert actions(conn) == []
    # An exception that does not exist is a 404, and leaves no row behind either.
    post(client, "/console/exceptions/987654/replay", token, status=404)
    assert actions(conn) == []


def test_exceptions_filter_by_kind_tenant_gateway_state_and_age(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    a, _, mismatch = mismatched(factory, conn)
    b = factory.shop()
    unmapped = StandardEvent(merchant_reference="nope", gateway_order_id="pi_nope")
    assert deliver(conn, b, unmapped) == "unmapped_order"
    old = StandardEvent(merchant_reference="nope", gateway_order_id="pi_old")
    assert deliver(conn, b, old) == "unmapped_order"
    conn.execute(
        "UPDATE payhook.payment_exceptions SET created_at = now() - interval '3 days'"
        " WHERE event_id = %s",
        (old.event_id,),
    )

    def listed(**query: str) -> set[str]:
        page = get(client, "/console/exceptions", **query)
        ids = {mismatch.event_id, unmapped.event_id, old.event_id}
        return {event_id for event_id in ids if event_id in page}

    everything = {mismatch.event_id, unmapped.event_id, old.event_id}
    assert listed() == everything
    assert listed(kind="unmapped_order") == {unmapped.event_id, old.event_id}
    assert listed(tenant=a.tenant_id) == {mismatch.event_id}
    assert listed(gateway="standard") == everything
    assert listed(gateway="stripe") == set()
    assert listed(newer_than="1d") == {mismatch.event_id, unmapped.event_id}
    assert listed(older_than="1d") == {old.event_id}
    assert listed(state="resolved") == set()
    assert listed(state="all", kind="amount_mismatch", tenant=a.tenant_id) == {mismatch.event_id}
    for bad in (
        {"kind": "bogus"},
        {"state": "closed"},
        {"gateway": "acme"},
        {"tenant": "not-a-uuid"},
        {"newer_than": "yesterday"},
        {"limit": "0"},
        {"limit": "9" * 50},
        {"before": "garbage"},
        {"before": "2026-01-01T00:00:00|x"},
        {"before": "2026-01-01T00:00:00+00:00|x"},
    ):
        assert "Not understood" in get(client, "/console/exceptions", 400, **bad)


def test_pages_walk_every_row_once_newest_first(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop = factory.shop()
    events = [
        StandardEvent(merchant_reference="nope", gateway_order_id=f"pi_{i}") for i in range(7)
    ]
    for event in events:
        assert deliver(conn, shop, event) == "unmapped_order"
    # Two exceptions created in the same instant: the id breaks the tie.
    conn.execute(
        "UPDATE payhook.payment_exceptions SET created_at = "
        "(SELECT max(created_at) FROM payhook.payment_exceptions) WHERE event_id IN (%s, %s)",
        (events[2].event_id, events[3].event_id),
    )
    order = [
        r["event_id"]
        for r in conn.execute(
            "SELECT event_id FROM payhook.payment_exceptions ORDER BY created_at DESC, id DESC"
        ).fetchall()
    ]
    seen: list[str] = []
    query: dict[str, str] = {"limit": "3"}
    for _ in range(5):
        page = get(client, "/console/exceptions", **query)
        seen += sorted(
            (e.event_id for e in events if e.event_id in page), key=lambda e: page.index(e)
        )
        older = re.search(r'href="([^"]*)" rel="next"', page)
        if older is None:
            break
        query = dict(parse_qsl(urlsplit(html.unescape(older.group(1))).query))
    assert seen == order


def test_orders_are_found_by_either_reference_in_every_tenant(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    a, b = factory.shop(), factory.shop()
    first = factory.order(a, merchant_reference="INV-7", gateway_order_id="pi_a")
    second = factory.order(b, merchant_reference="INV-7", gateway_order_id="pi_b")
    other = factory.order(b, merchant_reference="INV-8", gateway_order_id="pi_c")
    paid = StandardEvent(merchant_reference="INV-7", gateway_order_id="pi_a", amount=1999)
    assert deliver(conn, a, paid) == "applied"
    page = get(client, "/console/orders", q="INV-7")
    assert first in page and second in page and other not in page
    assert paid.event_id in page  # the event that moved the first
    page = get(client, "/console/orders", q="pi_c")
    assert other in page and first not in page
    assert "No order of any tenant" in get(client, "/console/orders", q="INV-404")
    get(client, "/console/orders", 400, q="x" * 501)


def test_anomalies_and_quarantined_jobs_are_listed(
    client: FlaskClient, conn: psycopg.Connection[Row], redis_conn: Redis, settings: Settings
) -> None:
    conn.execute(
        "INSERT INTO payhook.security_anomalies (kind, event_id, stored_sha256, received_sha256)"
        " VALUES ('digest_conflict', 'evt_conflict', repeat('a', 64), repeat('b', 64)),"
        " ('malformed_job', NULL, NULL, NULL)"
    )
    quarantine.move(redis_conn, settings.queue, b"job-unreadable", "data: not JSON")
    page = get(client, "/console/anomalies")
    assert "evt_conflict" in page and "malformed_job" in page
    assert "job-unreadable" in page and "data: not JSON" in page
    page = get(client, "/console/anomalies", kind="digest_conflict")
    assert "evt_conflict" in page and '<td class="kind" title' in page
    assert page.count("malformed_job") == 1  # the filter's option only


def test_reconciliation_runs_are_listed(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop = factory.shop()
    conn.execute(
        "INSERT INTO payhook.reconcile_runs (tenant_id, id, endpoint_id, window_start,"
        " window_end, listed, missing, queued, error, finished_at) VALUES (%s, %s, %s,"
        " now() - interval '72 hours', now(), 40, 3, 2, 'stripe: 500 after 2 pages', now())",
        (shop.tenant_id, uuid.uuid4(), shop.endpoint_id),
    )
    page = get(client, "/console/reconcile")
    assert shop.endpoint_id in page and "stripe: 500 after 2 pages" in page
    assert re.search(r"<td>40</td>\s*<td class=\"kind\">3</td>\s*<td>2</td>", page)


def test_no_payload_secret_or_markup_reaches_a_page(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    hostile = StandardEvent(
        event_id="evt_<script>alert(1)</script>",
        merchant_reference="<b>ref</b>",
        gateway_order_id="pi_<i>x</i>",
    )
    assert deliver(conn, shop, hostile) == "unmapped_order"
    marker = "4111-1111-payload-marker"
    conn.execute(
        "UPDATE payhook.payment_exceptions SET event = event || %s", (f'{{"pan": "{marker}"}}',)
    )
    (row,) = factory.outbox_rows(shop, order_id)
    conn.execute(
        "UPDATE payhook.payment_outbox SET state = 'dead', payload = payload || %s WHERE id = %s",
        (f'{{"pan": "{marker}"}}', row),
    )
    secrets = conn.execute(
        "SELECT e.secrets, t.signing_secret FROM payhook.webhook_endpoints AS e"
        " JOIN payhook.tenants AS t ON t.id = e.tenant_id WHERE e.id = %s",
        (shop.endpoint_id,),
    ).fetchone()
    assert secrets is not None
    hostile_trace = {"tenant": shop.tenant_id, "event": hostile.event_id}
    pages = [
        get(client, f"/console/{name}", **query)
        for name, query in (
            ("exceptions", {}),
            ("exceptions", {"state": "all"}),
            ("anomalies", {}),
            ("outbox", {}),
            ("orders", {"q": "order-1"}),
            ("reconcile", {}),
            ("trace", hostile_trace),
        )
    ]
    for page in pages:
        assert marker not in page and shop.secret not in page
        for sealed in [*secrets["secrets"], secrets["signing_secret"]]:
            assert str(sealed) not in page
        assert "<script>alert" not in page and "<b>ref" not in page and "<i>x" not in page
    assert "evt_&lt;script&gt;alert(1)&lt;/script&gt;" in pages[0]
    assert "evt_&lt;script&gt;alert(1)&lt;/script&gt;" in pages[-1]


def test_reads_across_tenants_are_counted_in_the_audit(
    client: FlaskClient, conn: psycopg.Connection[Row]
) -> None:
    for name, query in (
        ("exceptions", {}),
        ("anomalies", {}),
        ("outbox", {}),
        ("orders", {"q": "x"}),
        ("reconcile", {}),
    ):
        get(client, f"/console/{name}", **query)
    paths = {r["path"] for r in conn.execute("SELECT path FROM payhook.cross_tenant_audit")}
    assert {
        "console_exceptions",
        "console_anomalies",
        "console_outbox",
        "console_orders",
        "console_reconcile_runs",
    } <= paths


CONSOLE_TABLES = (
    "payment_exceptions",
    "security_anomalies",
    "payment_outbox",
    "payment_orders",
    "reconcile_runs",
)


def scans(conn: psycopg.Connection[Row]) -> dict[str, tuple[int, int]]:
    """Sequential and index scans of the console's tables so far."""
    rows = conn.execute(
        "SELECT relname, seq_scan, coalesce(idx_scan, 0) AS idx_scan"
        " FROM pg_stat_user_tables WHERE schemaname = 'payhook' AND relname = ANY(%s)",
        (list(CONSOLE_TABLES),),
    ).fetchall()
    return {r["relname"]: (r["seq_scan"], r["idx_scan"]) for r in rows}


def test_every_list_reads_a_page_on_an_index_never_the_whole_table(
    client: FlaskClient, conn: psycopg.Connection[Row], factory: Factory, settings: Settings
) -> None:
    shop, other = factory.shop(), factory.shop()
    rows = 3000
    params = {"t": shop.tenant_id, "e": shop.endpoint_id, "n": rows}
    conn.execute(
        "INSERT INTO payhook.payment_orders (tenant_id, id, merchant_reference,"
        " gateway_order_id, amount_minor, currency)"
        " SELECT %(t)s, gen_random_uuid(), 'ref-' || i, 'pi_' || i, 100, 'EUR'"
        " FROM generate_series(1, %(n)s) AS i",
        params,
    )
    conn.execute(
        "INSERT INTO payhook.payment_exceptions (tenant_id, event_id, kind, event, created_at,"
        " resolved_at) SELECT %(t)s, 'evt_' || i, 'unmapped_order', '{}',"
        " now() - i * interval '1 minute', CASE WHEN i %% 2 = 0 THEN now() END"
        " FROM generate_series(1, %(n)s) AS i",
        params,
    )
    conn.execute(
        "INSERT INTO payhook.security_anomalies (kind, detected_at)"
        " SELECT 'malformed_job', now() - i * interval '1 minute'"
        " FROM generate_series(1, %(n)s) AS i",
        params,
    )
    conn.execute(
        "INSERT INTO payhook.payment_outbox (id, tenant_id, order_id, event_id, action, payload,"
        " state, created_at) SELECT gen_random_uuid(), o.tenant_id, o.id,"
        " 'evt_' || o.merchant_reference, 'fulfil_order', '{}',"
        " CASE WHEN random() < 0.5 THEN 'dead' ELSE 'pending' END,"
        " now() - interval '1 day' FROM payhook.payment_orders AS o WHERE o.tenant_id = %(t)s",
        params,
    )
    conn.execute(
        "INSERT INTO payhook.reconcile_runs (tenant_id, id, endpoint_id, window_start,"
        " window_end, started_at) SELECT %(t)s, gen_random_uuid(), %(e)s,"
        " now() - interval '3 days', now(), now() - i * interval '1 minute'"
        " FROM generate_series(1, %(n)s) AS i",
        params,
    )
    for table in CONSOLE_TABLES:
        conn.execute(f"ANALYZE payhook.{table}")
    before = scans(conn)
    middle = "2026-01-01T00:00:00+00:00|1500"
    pages = [
        ("exceptions", {}),
        ("exceptions", {"state": "all"}),
        ("exceptions", {"state": "resolved", "before": middle}),
        ("exceptions", {"tenant": other.tenant_id}),
        ("exceptions", {"tenant": shop.tenant_id, "state": "all"}),
        ("exceptions", {"kind": "second_payment", "newer_than": "2h"}),
        ("exceptions", {"older_than": "10h", "gateway": "standard"}),
        ("anomalies", {}),
        ("anomalies", {"kind": "malformed_job", "before": middle}),
        ("outbox", {}),
        ("outbox", {"view": "overdue"}),
        ("orders", {"q": "ref-1234"}),
        ("orders", {"q": "pi_99"}),
        ("reconcile", {}),
    ]
    for name, query in pages:
        get(client, f"/console/{name}", **query)
    # Each request's connection has closed, reporting its backend's counts;
    # they land in the statistics within a moment.
    deadline = time.monotonic() + 10
    while True:
        after = scans(conn)
        if all(after[t][1] > before[t][1] for t in CONSOLE_TABLES) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for table in CONSOLE_TABLES:
        assert after[table][0] == before[table][0], f"{table} was read whole"
        assert after[table][1] > before[table][1], f"{table} was not read on an index"
