"""Migrations: ordered, gapless, idempotent, safe to run concurrently."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from control.migrations import apply_migrations, list_migrations
from payhook.db import Row
from payhook.errors import MigrationError
from payhook.queries import all_queries
from tests.conftest import PG_SERVER, test_settings

PREPARABLE = ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH")


@pytest.fixture
def empty_db() -> Iterator[str]:
    name = f"payhook_test_empty_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def test_migration_files_are_well_named_and_gapless() -> None:
    migrations = list_migrations()
    assert [m.version for m in migrations] == list(range(1, len(migrations) + 1))


def test_gaps_and_bad_names_are_refused(tmp_path: Path) -> None:
    (tmp_path / "0001_a.sql").write_text("SELECT 1;")
    (tmp_path / "0003_c.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match="gapless"):
        list_migrations(tmp_path)
    (tmp_path / "0003_c.sql").rename(tmp_path / "2_b.sql")
    with pytest.raises(MigrationError, match="0001_short_name"):
        list_migrations(tmp_path)


def test_empty_database_gets_everything_then_nothing(empty_db: str) -> None:
    settings = test_settings(empty_db)
    applied = apply_migrations(settings)
    assert applied == [m.path.name for m in list_migrations()]
    assert apply_migrations(settings) == []


def test_three_concurrent_migrate_processes_all_succeed(empty_db: str) -> None:
    env = os.environ | {"DATABASE_URL": f"{PG_SERVER}/{empty_db}"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "control.cli", "migrate"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    total = len(list_migrations())
    counts = sorted(int(out.split()[1]) for out, _ in outputs)
    assert counts == [0, 0, total]
    with psycopg.connect(f"{PG_SERVER}/{empty_db}") as conn:
        rows = conn.execute("SELECT count(*) FROM payhook.schema_migrations").fetchone()
        assert rows == (total,)


def positional(text: str) -> str:
    """`%(name)s` placeholders as `$1`, `$2`, ... for PREPARE."""
    params: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        params.setdefault(match.group(1), len(params) + 1)
        return f"${params[match.group(1)]}"

    return re.sub(r"%\((\w+)\)s", number, text)


def test_every_named_query_prepares(conn: psycopg.Connection[Row]) -> None:
    prepared = 0
    for name, text in all_queries().items():
        if not text.lstrip().upper().startswith(PREPARABLE):
            continue
        conn.execute(f"PREPARE q_{name} AS {positional(text)}")
        conn.execute(f"DEALLOCATE q_{name}")
        prepared += 1
    assert prepared >= 10


def test_every_unique_constraint_of_a_tenant_table_begins_with_tenant_id(
    conn: psycopg.Connection[Row],
) -> None:
    rows = conn.execute(
        """
        SELECT c.relname AS table_name, i.relname AS index_name,
               (SELECT attname FROM pg_attribute
                 WHERE attrelid = c.oid AND attnum = x.indkey[0]) AS first_column
          FROM pg_index x
          JOIN pg_class c ON c.oid = x.indrelid
          JOIN pg_class i ON i.oid = x.indexrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'payhook' AND x.indisunique
           -- Rows that may belong to no tenant (an anomaly or an operator's
           -- action before any tenant is known) are keyed by their own id.
           AND c.relname NOT IN ('tenants', 'security_anomalies', 'operator_actions',
                                 'schema_migrations', 'endpoint_version', 'cross_tenant_audit')
        """
    ).fetchall()
    assert rows, "no unique constraints found"
    assert {r["index_name"]: r["first_column"] for r in rows} == {
        r["index_name"]: "tenant_id" for r in rows
    }
    names = {r["index_name"] for r in rows}
    assert {
        "payment_event_receipts_pkey",
        "payment_outbox_action_key",
        "payment_orders_merchant_reference_key",
        "payment_orders_gateway_order_id_key",
    } <= names


def test_concurrent_runs_of_a_create_index_concurrently_migration_do_not_deadlock(
    empty_db: str, tmp_path: Path
) -> None:
    """Waiting for the migration lock must hold no snapshot, or CONCURRENTLY waits for it."""
    (tmp_path / "0001_table.sql").write_text("CREATE TABLE public.t (tenant_id int, x int);")
    (tmp_path / "0002_index.sql").write_text(
        "-- payhook: no-transaction\n"
        "CREATE UNIQUE INDEX CONCURRENTLY t_key ON public.t (tenant_id, x);\n"
    )
    settings = test_settings(empty_db)
    results: list[object] = []

    def migrate() -> None:
        try:
            results.append(apply_migrations(settings, tmp_path))
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a migration run hung"
    assert sorted(len(r) for r in results if isinstance(r, list)) == [0, 0, 2], results


def test_a_no_transaction_migration_postgresql_cannot_parse_is_refused_before_it_runs(
    empty_db: str, tmp_path: Path
) -> None:
    (tmp_path / "0001_table.sql").write_text("CREATE TABLE public.t (tenant_id int, x int);")
    (tmp_path / "0002_index.sql").write_text(
        "-- payhook: no-transaction\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS t_x ON public.t (x);\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS t_y ON public.t (tenant_id) WHERE;\n"
    )
    with pytest.raises(MigrationError, match=r"0002_index\.sql: PostgreSQL cannot parse"):
        apply_migrations(test_settings(empty_db), tmp_path)
    with psycopg.connect(f"{PG_SERVER}/{empty_db}") as conn:
        made = conn.execute("SELECT to_regclass('public.t_x') IS NULL").fetchone()
    assert made == (True,), "its first statement did not run either"
