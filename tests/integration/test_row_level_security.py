"""Row-level security: PostgreSQL keeps each tenant's rows apart.

Two tenants, A and B, with a row of every tenant table each, written the way
payhook writes them (the consumer under `payhook_app`) or, for the tables
only tooling writes, by the owner. Then, as a role subject to the policies,
with tenant A set or none: nothing of B is seen, changed or deleted.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from consumer.handler import Runtime, handle
from payhook.db import Row, connect, fetch_all, tenant_transaction
from payhook.errors import DatabaseRoleError
from payhook.settings import Settings
from tests.conftest import PG_SERVER, test_settings
from tests.factories import Factory, Shop, StandardEvent
from tests.harness import refresh, running

#: Every table of schema payhook with a tenant column, and that column.
TENANT_TABLES = {
    "tenants": "id",
    "webhook_endpoints": "tenant_id",
    "payment_orders": "tenant_id",
    "payment_event_receipts": "tenant_id",
    "payment_order_transitions": "tenant_id",
    "payment_outbox": "tenant_id",
    "payment_exceptions": "tenant_id",
    "security_anomalies": "tenant_id",
    "payment_event_receipts_archive": "tenant_id",
    "uniqueness_conflicts": "tenant_id",
    "uniqueness_quarantine": "tenant_id",
    "reconcile_runs": "tenant_id",
    "operator_actions": "tenant_id",
}

#: The functions that may read across tenants, and only these.
CROSS_TENANT_FUNCTIONS = {
    "alert_signals_v1",
    "alert_signals_v2",
    "any_sealed_secret_v1",
    "any_sealed_secret_v2",
    "audit_cross_tenant",
    "claim_outbox_v1",
    "claim_outbox_v2",
    "endpoint_v1",
    "endpoint_v2",
    "ingress_endpoints_v1",
    "ingress_endpoints_v2",
    "next_outbox_due_v1",
    "operator_anomalies_page_v1",
    "operator_anomalies_v1",
    "operator_exceptions_page_v1",
    "operator_exceptions_v1",
    "operator_orders_v1",
    "operator_outbox_page_v1",
    "operator_outbox_v1",
    "operator_reconcile_runs_v1",
    "operator_retry_dead_outbox_v1",
    "retention_archive_receipts_v1",
    "retention_count_expired_v1",
    "retention_delete_anomalies_v1",
    "retention_delete_exceptions_v1",
    "retention_delete_outbox_v1",
    "tenant_of_v1",
}


@dataclass
class Tenants:
    a: Shop
    b: Shop


def populate(runtime: Runtime, factory: Factory, shop: Shop) -> None:
    """A row of every tenant table for `shop`'s tenant."""
    factory.order(shop, "order-1", "pi_1")
    applied = StandardEvent(event_id=f"evt_paid_{shop.tenant_id}")
    assert handle(runtime, factory.standard_envelope(shop, applied).to_json()).outcome == "applied"
    unmapped = StandardEvent(
        event_id=f"evt_unmapped_{shop.tenant_id}", merchant_reference="x", gateway_order_id="y"
    )
    assert handle(runtime, factory.standard_envelope(shop, unmapped).to_json()).outcome == (
        "unmapped_order"
    )
    conflicting = StandardEvent(event_id=applied.event_id, amount=1)
    handle(runtime, factory.standard_envelope(shop, conflicting).to_json())
    conn = factory.conn
    conn.execute(
        "INSERT INTO payhook.payment_event_receipts_archive"
        " (tenant_id, event_id, payload_sha256, outcome, received_at)"
        " VALUES (%s, 'evt_archived', sha256(''::bytea), 'applied', now())",
        (shop.tenant_id,),
    )
    conn.execute(
        "INSERT INTO payhook.uniqueness_conflicts"
        " (tenant_id, rule, table_name, key, copies, versions, classification)"
        " VALUES (%s, 'rule', 'payment_orders', '[]', 2, 1, 'redelivery')",
        (shop.tenant_id,),
    )
    conn.execute(
        "INSERT INTO payhook.uniqueness_quarantine (tenant_id, rule, table_name, key, row_data)"
        " VALUES (%s, 'rule', 'payment_orders', '[]', '{}')",
        (shop.tenant_id,),
    )
    conn.execute(
        "INSERT INTO payhook.operator_actions (actor, source, action, object_kind, object_id,"
        " tenant_id) VALUES ('test', 'cli', 'order_add', 'order', 'o1', %s)",
        (shop.tenant_id,),
    )
    conn.execute(
        "INSERT INTO payhook.reconcile_runs (tenant_id, id, endpoint_id, window_start, window_end)"
        " VALUES (%s, gen_random_uuid(), %s, now() - interval '1 day', now())",
        (shop.tenant_id, shop.endpoint_id),
    )


@pytest.fixture
def tenants(runtime: Runtime, factory: Factory) -> Tenants:
    found = Tenants(factory.shop(), factory.shop())
    populate(runtime, factory, found.a)
    populate(runtime, factory, found.b)
    for table, column in TENANT_TABLES.items():
        for shop in (found.a, found.b):
            assert count_as_owner(factory, table, column, shop.tenant_id) > 0, table
    return found


def count_as_owner(factory: Factory, table: str, column: str, tenant_id: str) -> int:
    row = factory.conn.execute(
        sql.SQL("SELECT count(*) AS n FROM payhook.{} WHERE {} = %s").format(
            sql.Identifier(table), sql.Identifier(column)
        ),
        (tenant_id,),
    ).fetchone()
    assert row is not None
    return int(row["n"])


@pytest.fixture
def unrestricted_role(settings: Settings) -> Iterator[Settings]:
    """Settings whose connections work as a role with every privilege on the
    schema's tables but BYPASSRLS: what stops it is the policies alone."""
    role = f"payhook_test_rls_{uuid.uuid4().hex[:8]}"
    database = psycopg.conninfo.conninfo_to_dict(settings.database_url)["dbname"]
    with psycopg.connect(f"{PG_SERVER}/{database}", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(role)))
        admin.execute(sql.SQL("GRANT USAGE ON SCHEMA payhook TO {}").format(sql.Identifier(role)))
        for what in ("TABLES", "SEQUENCES"):
            admin.execute(
                sql.SQL(f"GRANT ALL ON ALL {what} IN SCHEMA payhook TO {{}}").format(
                    sql.Identifier(role)
                )
            )
    yield test_settings(str(database), PAYHOOK_DATABASE_ROLE=role)
    with psycopg.connect(f"{PG_SERVER}/{database}", autocommit=True) as admin:
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_every_table_with_a_tenant_column_is_under_forced_row_level_security(
    conn: psycopg.Connection[Row],
) -> None:
    rows = conn.execute(
        """
        SELECT c.relname, c.relrowsecurity, c.relforcerowsecurity,
               (SELECT count(*) FROM pg_policy AS p WHERE p.polrelid = c.oid) AS policies
          FROM pg_class AS c
          JOIN pg_namespace AS n ON n.oid = c.relnamespace
         WHERE n.nspname = 'payhook' AND c.relkind = 'r'
           AND (EXISTS (SELECT 1 FROM pg_attribute AS a
                         WHERE a.attrelid = c.oid AND a.attname = 'tenant_id' AND a.attnum > 0)
                OR c.relname = 'tenants')
        """
    ).fetchall()
    assert {r["relname"] for r in rows} == set(TENANT_TABLES)
    for row in rows:
        assert (row["relrowsecurity"], row["relforcerowsecurity"], row["policies"]) == (
            True,
            True,
            1,
        ), row["relname"]


def test_the_processes_connect_as_payhook_app(settings: Settings, runtime: Runtime) -> None:
    with connect(settings) as conn:
        assert conn.execute("SELECT current_user AS who").fetchone() == {"who": "payhook_app"}
    with runtime.pool.connection() as pooled:
        assert pooled.execute("SELECT current_user AS who").fetchone() == {"who": "payhook_app"}
    with connect(settings, owner=True) as owner:
        who = owner.execute(
            "SELECT rolbypassrls OR rolsuper AS bypasses"
            " FROM pg_roles WHERE rolname = 'payhook_app'"
        ).fetchone()
    assert who == {"bypasses": False}


@pytest.mark.parametrize("role", ["payhook_app", "unrestricted"])
def test_under_tenant_a_nothing_of_tenant_b_is_seen_changed_or_deleted(
    tenants: Tenants,
    factory: Factory,
    settings: Settings,
    unrestricted_role: Settings,
    role: str,
) -> None:
    chosen = settings if role == "payhook_app" else unrestricted_role
    a, b = tenants.a.tenant_id, tenants.b.tenant_id
    before = {t: count_as_owner(factory, t, c, b) for t, c in TENANT_TABLES.items()}
    with connect(chosen, "test") as conn:
        for table, column in TENANT_TABLES.items():
            name, col = sql.Identifier(table), sql.Identifier(column)
            try:
                with tenant_transaction(conn, a):
                    seen = conn.execute(
                        sql.SQL("SELECT DISTINCT {}::text AS tenant FROM payhook.{}").format(
                            col, name
                        )
                    ).fetchall()
            except psycopg.errors.InsufficientPrivilege:
                assert role == "payhook_app", table  # tooling's tables: not granted
            else:
                assert seen == [{"tenant": a}], table
            for statement in (
                sql.SQL("UPDATE payhook.{} SET {} = {} WHERE {} = %s"),
                sql.SQL("DELETE FROM payhook.{} WHERE {} = %s"),
            ):
                query = (
                    statement.format(name, col, col, col)
                    if statement.as_string(conn).startswith("UPDATE")
                    else statement.format(name, col)
                )
                try:
                    with tenant_transaction(conn, a):
                        touched = conn.execute(query, (b,)).rowcount
                except psycopg.errors.InsufficientPrivilege:
                    assert role == "payhook_app", table  # not granted: touches nothing either
                else:
                    assert touched == 0, (table, query.as_string(conn))
    after = {t: count_as_owner(factory, t, c, b) for t, c in TENANT_TABLES.items()}
    assert after == before


def test_a_row_of_another_tenant_cannot_be_written_under_tenant_a(
    tenants: Tenants, app_conn: psycopg.Connection[Row]
) -> None:
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
        with tenant_transaction(app_conn, tenants.a.tenant_id):
            app_conn.execute(
                "INSERT INTO payhook.payment_orders"
                " (tenant_id, id, merchant_reference, gateway_order_id, amount_minor, currency)"
                " VALUES (%s, gen_random_uuid(), 'r', 'g', 100, 'EUR')",
                (tenants.b.tenant_id,),
            )
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
        with tenant_transaction(app_conn, tenants.a.tenant_id):
            app_conn.execute(
                "UPDATE payhook.payment_orders SET tenant_id = %s WHERE tenant_id = %s",
                (tenants.b.tenant_id, tenants.a.tenant_id),
            )


@pytest.mark.parametrize("role", ["payhook_app", "unrestricted"])
def test_with_no_tenant_set_nothing_is_seen(
    tenants: Tenants, settings: Settings, unrestricted_role: Settings, role: str
) -> None:
    chosen = settings if role == "payhook_app" else unrestricted_role
    with connect(chosen, "test") as conn:
        for table in TENANT_TABLES:
            try:
                row = conn.execute(
                    sql.SQL("SELECT count(*) AS n FROM payhook.{}").format(sql.Identifier(table))
                ).fetchone()
            except psycopg.errors.InsufficientPrivilege:
                assert role == "payhook_app", table  # tooling's tables: not granted
            else:
                assert row == {"n": 0}, table
        # A tenant set in a transaction ends with it.
        with tenant_transaction(conn, tenants.a.tenant_id):
            pass
        assert conn.execute("SELECT count(*) AS n FROM payhook.payment_orders").fetchone() == {
            "n": 0
        }


def test_only_the_listed_functions_cross_tenants_and_payhook_app_alone_calls_them(
    conn: psycopg.Connection[Row],
) -> None:
    rows = conn.execute(
        """
        SELECT p.proname, p.proconfig,
               has_function_privilege('payhook_app', p.oid, 'EXECUTE') AS app,
               has_function_privilege('public', p.oid, 'EXECUTE') AS anyone
          FROM pg_proc AS p
          JOIN pg_namespace AS n ON n.oid = p.pronamespace
         WHERE n.nspname = 'payhook' AND p.prosecdef
        """
    ).fetchall()
    assert {r["proname"] for r in rows} == CROSS_TENANT_FUNCTIONS
    for row in rows:
        assert row["proconfig"] == ["search_path=pg_catalog, pg_temp"], row["proname"]
        assert not row["anyone"], row["proname"]
        assert row["app"] == (row["proname"] != "audit_cross_tenant"), row["proname"]


def test_operators_paths_across_tenants_are_counted_in_the_audit(
    tenants: Tenants, app_conn: psycopg.Connection[Row], conn: psycopg.Connection[Row]
) -> None:
    rows = fetch_all(
        app_conn,
        "list_every_tenants_exceptions",
        {"include_resolved": True, "kind": None, "limit": 10},
    )
    assert {str(r["tenant_id"]) for r in rows} == {tenants.a.tenant_id, tenants.b.tenant_id}
    fetch_all(
        app_conn,
        "list_every_tenants_exceptions",
        {"include_resolved": True, "kind": None, "limit": 10},
    )
    audit = conn.execute(
        "SELECT login, path, calls FROM payhook.cross_tenant_audit WHERE path = 'list_exceptions'"
    ).fetchall()
    assert audit == [{"login": "postgres", "path": "list_exceptions", "calls": 2}]
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        app_conn.execute("SELECT payhook.audit_cross_tenant('forged')")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_ingress_reads_its_endpoints_as_the_configured_role(
    factory: Factory, settings: Settings, unrestricted_role: Settings
) -> None:
    """The role it is given, not the login's: one that may not call the
    ingress's function reads no endpoint, and the ingress is not ready."""
    shop = factory.shop()
    async with running(test_settings(_database(settings), PAYHOOK_ENDPOINT_REFRESH="1h")) as ok:
        assert await refresh(ok)
        assert ok.ingress.cache.get(shop.endpoint_id) is not None
    async with running(unrestricted_role) as refused:
        assert not await refresh(refused)
        assert not refused.ingress.cache.loaded


def test_a_login_that_cannot_take_the_role_is_told_which_setting(settings: Settings) -> None:
    missing = test_settings(_database(settings), PAYHOOK_DATABASE_ROLE="payhook_nobody")
    with pytest.raises(DatabaseRoleError, match=r"PAYHOOK_DATABASE_ROLE: .*'payhook_nobody'"):
        connect(missing)
    login = f"payhook_test_login_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(login)))
    try:
        url = PG_SERVER.replace("//postgres@", f"//{login}@", 1)
        outsider = test_settings(_database(settings), DATABASE_URL=f"{url}/{_database(settings)}")
        with pytest.raises(DatabaseRoleError, match="GRANT payhook_app TO"):
            connect(outsider)
    finally:
        with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(login)))


def _database(settings: Settings) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(settings.database_url)["dbname"])
