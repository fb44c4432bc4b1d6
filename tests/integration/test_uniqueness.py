"""Unique rules on live tables: the pre-check, its classification, and a runner that is careful."""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from control import migrations
from control.migrations import apply_migrations, list_migrations
from control.unique_rules import RuleError, UniqueRule, rules_in
from control.uniqueness import (
    UnresolvedConflicts,
    check_rule,
    remaining_conflicts,
    resolve_rule,
)
from payhook.db import Row, connect, fetch_one
from payhook.errors import MigrationError
from payhook.settings import Settings
from tests.conftest import PG_SERVER, test_settings
from tests.processes import run_cli

RULE = "payment_exceptions_event_kind_key"
#: One exception per event and kind, added the live-table way.
RULE_MIGRATION = f"""-- payhook: no-transaction
-- One exception per event and kind.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {RULE}
    ON payhook.payment_exceptions (tenant_id, event_id, kind);
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = '{RULE}') THEN
        ALTER TABLE payhook.payment_exceptions
            ADD CONSTRAINT {RULE} UNIQUE USING INDEX {RULE};
    END IF;
END
$$;
"""
EXCEPTIONS_RULE = UniqueRule(RULE, "payhook.payment_exceptions", ("tenant_id", "event_id", "kind"))
TENANT = str(uuid.uuid4())


def folder_with(tmp_path: Path, name: str, text: str) -> Path:
    """The project's migrations followed by one more."""
    folder = tmp_path / "migrations"
    folder.mkdir(exist_ok=True)
    existing = list_migrations()
    for migration in existing:
        shutil.copy(migration.path, folder / migration.path.name)
    (folder / f"{len(existing) + 1:04d}_{name}.sql").write_text(text)
    return folder


def add_exception(
    conn: psycopg.Connection[Row],
    event_id: str,
    kind: str = "amount_mismatch",
    detail: dict[str, Any] | None = None,
    tenant_id: str = TENANT,
) -> None:
    conn.execute(
        "INSERT INTO payhook.payment_exceptions (tenant_id, event_id, kind, detail, event)"
        " VALUES (%s, %s, %s, %s, %s)",
        (tenant_id, event_id, kind, Jsonb(detail or {"expected": 1999}), Jsonb({"id": event_id})),
    )


def index_state(conn: psycopg.Connection[Row]) -> Row | None:
    """Whether the rule's index is valid and backs its constraint (None: no index)."""
    found = fetch_one(conn, "index_state", {"table": EXCEPTIONS_RULE.table, "index": RULE})
    return None if found is None else {k: found[k] for k in ("valid", "constrained")}


def recorded(conn: psycopg.Connection[Row]) -> int:
    row = conn.execute("SELECT max(version) AS v FROM payhook.schema_migrations").fetchone()
    assert row is not None
    return int(row["v"])


def test_unique_rules_are_read_from_migration_sql() -> None:
    text = """
    -- CREATE UNIQUE INDEX commented_out ON payhook.t (tenant_id, x);
    CREATE INDEX CONCURRENTLY plain ON payhook.t (created_at);
    CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS one
        ON payhook.t USING btree (tenant_id, a DESC, b) WHERE resolved_at IS NULL;
    ALTER TABLE payhook.u ADD CONSTRAINT two UNIQUE NULLS NOT DISTINCT (tenant_id, c);
    ALTER TABLE payhook.u ADD CONSTRAINT three UNIQUE USING INDEX one;
    """
    assert rules_in(text) == [
        UniqueRule("one", "payhook.t", ("tenant_id", "a", "b"), "resolved_at IS NULL"),
        UniqueRule("two", "payhook.u", ("tenant_id", "c"), nulls_distinct=False),
    ]
    expression = "CREATE UNIQUE INDEX e ON payhook.t (tenant_id, lower(x));"
    with pytest.raises(RuleError, match="cannot read the unique rule"):
        rules_in(expression)
    assert rules_in(expression, strict=False) == [], "the runner leaves it to the build"


def test_check_classifies_redeliveries_and_distinct_rows_into_the_report(
    conn: psycopg.Connection[Row],
) -> None:
    add_exception(conn, "evt_twice")
    add_exception(conn, "evt_twice")
    add_exception(conn, "evt_twice")
    add_exception(conn, "evt_differs", detail={"expected": 1})
    add_exception(conn, "evt_differs", detail={"expected": 2})
    add_exception(conn, "evt_once")
    add_exception(conn, "evt_once", kind="unmapped_order")

    report = check_rule(conn, EXCEPTIONS_RULE)

    summary = report.summary()
    assert (summary["groups"], summary["rows"]) == (2, 5)
    assert (summary["redelivery"], summary["distinct"]) == (1, 1)
    assert summary["ignored"] == ["id", "created_at"], "the identity and the arrival stamp"
    assert summary["distinct_examples"] == [
        {"tenant_id": TENANT, "event_id": "evt_differs", "kind": "amount_mismatch"}
    ]
    rows = conn.execute(
        "SELECT key, copies, versions, classification FROM payhook.uniqueness_conflicts"
        " WHERE rule = %s AND resolved_at IS NULL ORDER BY classification",
        (RULE,),
    ).fetchall()
    assert [
        (r["key"]["event_id"], r["copies"], r["versions"], r["classification"]) for r in rows
    ] == [
        ("evt_differs", 2, 2, "distinct"),
        ("evt_twice", 3, 1, "redelivery"),
    ]

    conn.execute("DELETE FROM payhook.payment_exceptions WHERE event_id = 'evt_differs'")
    assert check_rule(conn, EXCEPTIONS_RULE).summary()["groups"] == 1
    closed = conn.execute(
        "SELECT resolved_at FROM payhook.uniqueness_conflicts"
        " WHERE key->>'event_id' = 'evt_differs'"
    ).fetchone()
    assert closed is not None and closed["resolved_at"] is not None, "gone since: resolved"


def test_columns_named_to_ignore_make_copies_of_one_event_a_redelivery(
    conn: psycopg.Connection[Row],
) -> None:
    add_exception(conn, "evt_1", detail={"attempt": 1})
    add_exception(conn, "evt_1", detail={"attempt": 2})
    assert check_rule(conn, EXCEPTIONS_RULE).summary()["distinct"] == 1
    assert check_rule(conn, EXCEPTIONS_RULE, ("detail",)).summary()["redelivery"] == 1
    with pytest.raises(RuleError, match="no column nope"):
        check_rule(conn, EXCEPTIONS_RULE, ("nope",))


def test_rows_with_nulls_in_the_key_do_not_conflict(conn: psycopg.Connection[Row]) -> None:
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_2")
    rule = UniqueRule("order_kind", "payhook.payment_exceptions", ("tenant_id", "order_id", "kind"))
    assert check_rule(conn, rule).groups == [], "order_id is null in both"
    strict = UniqueRule(rule.name, rule.table, rule.columns, nulls_distinct=False)
    assert len(check_rule(conn, strict).groups) == 1


def test_a_rule_of_a_tenant_table_must_begin_with_tenant_id(
    conn: psycopg.Connection[Row],
) -> None:
    rule = UniqueRule("by_event", "payhook.payment_exceptions", ("event_id", "kind"))
    with pytest.raises(RuleError, match="begins with tenant_id"):
        check_rule(conn, rule)


@pytest.mark.parametrize(
    "statement",
    [
        "ALTER TABLE payhook.payment_exceptions ADD UNIQUE (event_id, kind)",
        'CREATE UNIQUE INDEX "By_Event" ON PayHook.Payment_Exceptions (Event_Id, Kind)',
    ],
)
def test_migrate_refuses_a_rule_of_a_tenant_table_not_beginning_with_tenant_id(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path, statement: str
) -> None:
    """Written without a name, or with quoted and upper-case names: read all the same."""
    folder = folder_with(tmp_path, "by_event", statement + ";\n")
    before = recorded(conn)
    with pytest.raises(MigrationError, match="begins with tenant_id"):
        apply_migrations(settings, folder)
    assert recorded(conn) == before


def test_migration_waits_for_classification_and_resolution_then_builds_the_rule(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    folder = folder_with(tmp_path, "exceptions_event_kind_key", RULE_MIGRATION)
    before = recorded(conn)
    add_exception(conn, "evt_twice")
    add_exception(conn, "evt_twice")
    add_exception(conn, "evt_ok")

    with pytest.raises(UnresolvedConflicts, match="1 not classified yet"):
        apply_migrations(settings, folder)
    assert index_state(conn) is None, "refused before building anything"
    assert recorded(conn) == before

    check_rule(conn, EXCEPTIONS_RULE)
    with pytest.raises(UnresolvedConflicts, match="1 the same event recorded twice"):
        apply_migrations(settings, folder)

    resolved = resolve_rule(conn, EXCEPTIONS_RULE)
    assert (resolved.collapsed, resolved.quarantined, resolved.reclassified) == (1, 1, 0)
    assert remaining_conflicts(conn, EXCEPTIONS_RULE) == {}

    assert apply_migrations(settings, folder) == [f"{before + 1:04d}_exceptions_event_kind_key.sql"]
    assert index_state(conn) == {"valid": True, "constrained": True}
    kept = conn.execute(
        "SELECT id FROM payhook.payment_exceptions WHERE event_id = 'evt_twice'"
    ).fetchall()
    quarantined = conn.execute(
        "SELECT row_data, key, table_name FROM payhook.uniqueness_quarantine"
    ).fetchall()
    assert len(kept) == 1 and len(quarantined) == 1
    assert quarantined[0]["row_data"]["id"] > kept[0]["id"], "the first row is the one kept"
    assert quarantined[0]["row_data"]["event_id"] == "evt_twice"
    with pytest.raises(psycopg.errors.UniqueViolation) as violation:
        add_exception(conn, "evt_ok")
    assert violation.value.diag.constraint_name == RULE


def test_a_rule_on_a_column_the_same_migration_adds_is_built_not_refused(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    """No row can break a rule before its column exists: the pre-check has
    nothing to read, and the index build is the check."""
    migration = """-- payhook: no-transaction
ALTER TABLE payhook.payment_exceptions
    ADD COLUMN IF NOT EXISTS source text NOT NULL DEFAULT 'gateway';
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS payment_exceptions_source_key
    ON payhook.payment_exceptions (tenant_id, event_id, kind, source);
"""
    folder = folder_with(tmp_path, "exceptions_source_key", migration)
    add_exception(conn, "evt_1")
    before = recorded(conn)
    assert apply_migrations(settings, folder) == [f"{before + 1:04d}_exceptions_source_key.sql"]
    found = fetch_one(
        conn,
        "index_state",
        {"table": "payhook.payment_exceptions", "index": "payment_exceptions_source_key"},
    )
    assert found is not None and found["valid"]


def test_distinct_rows_block_the_migration_and_are_never_removed(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    folder = folder_with(tmp_path, "exceptions_event_kind_key", RULE_MIGRATION)
    add_exception(conn, "evt_1", detail={"expected": 1})
    add_exception(conn, "evt_1", detail={"expected": 2})
    check_rule(conn, EXCEPTIONS_RULE)
    assert resolve_rule(conn, EXCEPTIONS_RULE).quarantined == 0
    with pytest.raises(UnresolvedConflicts, match="1 legitimate rows the rule forbids"):
        apply_migrations(settings, folder)
    assert conn.execute("SELECT count(*) AS n FROM payhook.payment_exceptions").fetchone() == {
        "n": 2
    }


def test_copies_that_stopped_agreeing_before_resolve_are_reclassified_distinct(
    conn: psycopg.Connection[Row],
) -> None:
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_1")
    check_rule(conn, EXCEPTIONS_RULE)
    conn.execute(
        "UPDATE payhook.payment_exceptions SET detail = '{\"expected\": 5}'"
        " WHERE id = (SELECT max(id) FROM payhook.payment_exceptions)"
    )
    resolved = resolve_rule(conn, EXCEPTIONS_RULE)
    assert (resolved.quarantined, resolved.reclassified) == (0, 1)
    assert remaining_conflicts(conn, EXCEPTIONS_RULE) == {"distinct": 1}


def test_a_copy_written_after_the_check_is_unclassified(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    folder = folder_with(tmp_path, "exceptions_event_kind_key", RULE_MIGRATION)
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_1")
    check_rule(conn, EXCEPTIONS_RULE)
    add_exception(conn, "evt_1")
    with pytest.raises(UnresolvedConflicts, match="1 not classified yet"):
        apply_migrations(settings, folder)


def test_an_index_left_invalid_by_a_failed_build_is_dropped_and_built_again(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    folder = folder_with(tmp_path, "exceptions_event_kind_key", RULE_MIGRATION)
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_1")
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(
            f"CREATE UNIQUE INDEX CONCURRENTLY {RULE}"
            " ON payhook.payment_exceptions (tenant_id, event_id, kind)"
        )
    assert index_state(conn) == {"valid": False, "constrained": False}
    conn.execute(
        "DELETE FROM payhook.payment_exceptions"
        " WHERE id = (SELECT max(id) FROM payhook.payment_exceptions)"
    )

    apply_migrations(settings, folder)

    assert index_state(conn) == {"valid": True, "constrained": True}


@pytest.mark.parametrize("written", [RULE, RULE.upper()], ids=["as stored", "upper case"])
def test_a_build_that_fails_leaves_no_invalid_index_behind(
    conn: psycopg.Connection[Row],
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    written: str,
) -> None:
    """Duplicates written between the pre-check and the build: the build fails
    cleanly, whichever case the migration writes the index's name in."""
    migration = RULE_MIGRATION.replace(f"IF NOT EXISTS {RULE}", f"IF NOT EXISTS {written}")
    folder = folder_with(tmp_path, "exceptions_event_kind_key", migration)
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_1")
    monkeypatch.setattr(migrations, "require_no_conflicts", lambda conn, rule: None)
    with pytest.raises(MigrationError, match="could not create unique index"):
        apply_migrations(settings, folder)
    assert index_state(conn) is None


def test_a_concurrent_build_without_an_index_name_is_refused_before_anything_runs(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    """PostgreSQL would name it, and an invalid index a failed build left could
    not be found to drop it: the next attempt would build a second one."""
    migration = (
        "-- payhook: no-transaction\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS exceptions_kind\n"
        "    ON payhook.payment_exceptions (kind);\n"
        "CREATE UNIQUE INDEX CONCURRENTLY\n"
        "    ON payhook.payment_exceptions (tenant_id, event_id, kind);\n"
    )
    folder = folder_with(tmp_path, "unnamed", migration)
    before = recorded(conn)
    with pytest.raises(MigrationError, match="a concurrent index build must name its index"):
        apply_migrations(settings, folder)
    assert recorded(conn) == before
    made = fetch_one(
        conn, "index_state", {"table": EXCEPTIONS_RULE.table, "index": "exceptions_kind"}
    )
    assert made is None, "refused before its first statement ran"


def test_blocked_ddl_gives_up_after_lock_timeout_and_writers_go_on(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    folder = folder_with(
        tmp_path, "exceptions_note", "ALTER TABLE payhook.payment_exceptions ADD COLUMN note text;"
    )
    before = recorded(conn)
    with connect(settings, "reader", owner=True) as reader, reader.transaction():
        reader.execute("SELECT count(*) FROM payhook.payment_exceptions")  # a long reader
        with pytest.raises(MigrationError, match="no lock within lock_timeout in 1 tries"):
            apply_migrations(settings, folder, lock_timeout="200ms", lock_attempts=1)
        add_exception(conn, "evt_written_while_the_reader_runs")
    assert recorded(conn) == before
    assert apply_migrations(settings, folder, lock_timeout="200ms", lock_attempts=1)


def test_blocked_ddl_is_tried_again_until_the_lock_is_free(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    folder = folder_with(
        tmp_path, "exceptions_note", "ALTER TABLE payhook.payment_exceptions ADD COLUMN note text;"
    )
    applied: list[list[str]] = []
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            applied.append(
                apply_migrations(settings, folder, lock_timeout="300ms", lock_attempts=5)
            )
        except BaseException as exc:
            errors.append(exc)

    with connect(settings, "reader", owner=True) as reader, reader.transaction():
        reader.execute("SELECT count(*) FROM payhook.payment_exceptions")
        runner = threading.Thread(target=migrate)
        runner.start()
        waits: set[datetime] = set()
        deadline = time.monotonic() + 30
        while len(waits) < 2 and time.monotonic() < deadline:
            row = conn.execute(
                "SELECT query_start FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'payhook-migrate' AND wait_event_type = 'Lock'"
            ).fetchone()
            if row is not None:
                waits.add(row["query_start"])
            time.sleep(0.02)
        assert len(waits) == 2, "the ALTER waited, gave up, and waited again"
    runner.join(timeout=30)
    assert errors == [] and len(applied[0]) == 1


def test_a_database_without_the_report_refuses_conflicts_as_unclassified(
    tmp_path: Path,
) -> None:
    """A rule on a table of a database migrated before the report existed."""
    name = f"payhook_test_bare_{uuid.uuid4().hex[:10]}"
    (tmp_path / "0001_table.sql").write_text(
        "CREATE TABLE public.t (tenant_id uuid, x int);"
        f" INSERT INTO public.t VALUES ('{TENANT}', 1), ('{TENANT}', 1), ('{TENANT}', 2);"
    )
    (tmp_path / "0002_index.sql").write_text(
        "-- payhook: no-transaction\n"
        "CREATE UNIQUE INDEX CONCURRENTLY t_key ON public.t (tenant_id, x);\n"
    )
    settings = test_settings(name)
    try:
        with pytest.raises(UnresolvedConflicts, match="1 not classified yet"):
            apply_migrations(settings, tmp_path)
        with connect(settings, owner=True) as conn:
            conn.execute("DELETE FROM public.t WHERE x = 2")
            conn.execute("UPDATE public.t SET x = 2 WHERE ctid = (SELECT min(ctid) FROM public.t)")
        assert apply_migrations(settings, tmp_path) == ["0002_index.sql"]
    finally:
        with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_uniqueness_commands_check_then_resolve(
    conn: psycopg.Connection[Row], database: str
) -> None:
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_1")
    rule = ["--rule", RULE, "--table", "payhook.payment_exceptions"]
    rule += ["--columns", "tenant_id,event_id,kind"]
    check = run_cli(test_settings(database), "uniqueness", "check", *rule)
    assert check.returncode == 1, check.stderr
    assert json.loads(check.stdout) | {"ignored": None} == {
        "rule": RULE,
        "table": "payhook.payment_exceptions",
        "columns": ["tenant_id", "event_id", "kind"],
        "ignored": None,
        "groups": 1,
        "rows": 2,
        "redelivery": 1,
        "distinct": 0,
        "distinct_examples": [],
    }
    resolve = run_cli(test_settings(database), "uniqueness", "resolve", *rule)
    assert resolve.returncode == 0, resolve.stderr
    assert json.loads(resolve.stdout)["quarantined"] == 1
    assert run_cli(test_settings(database), "uniqueness", "check", *rule).returncode == 0


def test_without_a_pending_rule_the_check_has_nothing_to_do(database: str) -> None:
    result = run_cli(test_settings(database), "uniqueness", "check")
    assert result.returncode == 0
    assert "no pending migration" in result.stderr


def test_a_rule_named_that_no_pending_migration_adds_is_an_error(database: str) -> None:
    result = run_cli(test_settings(database), "uniqueness", "check", "--rule", "no_such_key")
    assert result.returncode == 2
    assert "--rule no_such_key: no pending migration adds it" in result.stderr


def test_resolve_refuses_a_partitioned_table_whose_ctids_repeat_across_partitions(
    conn: psycopg.Connection[Row],
) -> None:
    """ctid names a row only within one physical table: deleting copies by
    ctid on a parent would remove rows of other partitions."""
    conn.execute(
        "CREATE TABLE public.parted (tenant_id uuid NOT NULL, k text) PARTITION BY LIST (tenant_id)"
    )
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    conn.execute(f"CREATE TABLE public.parted_a PARTITION OF public.parted FOR VALUES IN ('{a}')")
    conn.execute(f"CREATE TABLE public.parted_b PARTITION OF public.parted FOR VALUES IN ('{b}')")
    conn.execute(
        "INSERT INTO public.parted VALUES (%s, 'x'), (%s, 'x'), (%s, 'y1'), (%s, 'y2')",
        (a, a, b, b),
    )
    rule = UniqueRule("parted_key", "public.parted", ("tenant_id", "k"))
    assert check_rule(conn, rule).summary()["groups"] == 1
    with pytest.raises(RuleError, match="is partitioned; check, then resolve, each partition"):
        resolve_rule(conn, rule)
    assert conn.execute("SELECT count(*) AS n FROM public.parted").fetchone() == {"n": 4}
    one = UniqueRule("parted_key", "public.parted_a", ("tenant_id", "k"))
    check_rule(conn, one)
    assert resolve_rule(conn, one).quarantined == 1
    rows = conn.execute("SELECT k FROM public.parted ORDER BY k").fetchall()
    assert [r["k"] for r in rows] == ["x", "y1", "y2"]


def test_partitions_checked_and_resolved_one_by_one_keep_their_own_groups(
    conn: psycopg.Connection[Row],
) -> None:
    """The way `resolve` asks for a partitioned table: each partition by name,
    under the rule's one name. Checking or resolving one partition leaves the
    other's groups open, and the guard on the parent reads the partitions'
    classifications, the graver one where the parent's check said otherwise."""
    conn.execute(
        "CREATE TABLE public.split (tenant_id uuid NOT NULL, k text, note text)"
        " PARTITION BY LIST (tenant_id)"
    )
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    for name, tenant in (("split_a", a), ("split_b", b)):
        conn.execute(
            f"CREATE TABLE public.{name} PARTITION OF public.split FOR VALUES IN ('{tenant}')"
        )
    conn.execute(
        "INSERT INTO public.split VALUES (%(a)s, 'x', 'n'), (%(a)s, 'x', 'n'),"
        " (%(b)s, 'y', 'n'), (%(b)s, 'y', 'n'), (%(b)s, 'z', 'n'), (%(b)s, 'z', 'other')",
        {"a": a, "b": b},
    )
    columns = ("tenant_id", "k")
    parent = UniqueRule("split_key", "public.split", columns)
    first, second = (UniqueRule("split_key", f"public.split_{p}", columns) for p in "ab")

    # Checked on the parent leaving out `note`, `z` reads as a redelivery there.
    assert check_rule(conn, parent, ("note",)).summary()["redelivery"] == 3
    with pytest.raises(RuleError, match="check, then resolve, each partition by name"):
        resolve_rule(conn, parent)
    assert check_rule(conn, first).summary()["groups"] == 1
    assert check_rule(conn, second).summary()["groups"] == 2

    def open_groups() -> list[tuple[str, str, str]]:
        rows = conn.execute(
            "SELECT table_name, key->>'k' AS k, classification FROM payhook.uniqueness_conflicts"
            " WHERE rule = 'split_key' AND table_name <> 'public.split' AND resolved_at IS NULL"
            " ORDER BY 1, 2"
        ).fetchall()
        return [(r["table_name"], r["k"], r["classification"]) for r in rows]

    assert open_groups() == [
        ("public.split_a", "x", "redelivery"),
        ("public.split_b", "y", "redelivery"),
        ("public.split_b", "z", "distinct"),
    ]
    assert resolve_rule(conn, first).quarantined == 1
    assert open_groups() == [
        ("public.split_b", "y", "redelivery"),
        ("public.split_b", "z", "distinct"),
    ], "the other partition's groups are still open"
    assert resolve_rule(conn, second).quarantined == 1
    assert open_groups() == [("public.split_b", "z", "distinct")]
    assert remaining_conflicts(conn, parent) == {"distinct": 1}


def test_a_rule_under_one_name_in_two_schemas_keeps_both_reports(
    conn: psycopg.Connection[Row],
) -> None:
    """Index names are unique per schema only: the report is keyed by table too."""
    tenant = str(uuid.uuid4())
    conn.execute("CREATE SCHEMA side")
    for table in ("public.dup", "side.dup"):
        conn.execute(f"CREATE TABLE {table} (tenant_id uuid NOT NULL, k text)")
        conn.execute(f"INSERT INTO {table} VALUES (%(t)s, 'x'), (%(t)s, 'x')", {"t": tenant})
    for table in ("public.dup", "side.dup"):
        assert check_rule(conn, UniqueRule("dup_key", table, ("tenant_id", "k"))).groups
    rows = conn.execute(
        "SELECT table_name FROM payhook.uniqueness_conflicts WHERE resolved_at IS NULL ORDER BY 1"
    ).fetchall()
    assert [r["table_name"] for r in rows] == ["public.dup", "side.dup"]


def test_a_rule_on_a_table_with_child_tables_covers_its_own_rows(
    conn: psycopg.Connection[Row],
) -> None:
    """An index on a parent by inheritance covers the parent's rows alone: the
    children's copies neither block the rule nor are resolved away."""
    tenant = str(uuid.uuid4())
    conn.execute("CREATE TABLE public.base (tenant_id uuid NOT NULL, k text)")
    conn.execute("CREATE TABLE public.kid () INHERITS (public.base)")
    conn.execute("INSERT INTO public.kid VALUES (%(t)s, 'x'), (%(t)s, 'x')", {"t": tenant})
    rule = UniqueRule("base_key", "public.base", ("tenant_id", "k"))
    assert check_rule(conn, rule).groups == []
    conn.execute("INSERT INTO public.base VALUES (%(t)s, 'x'), (%(t)s, 'x')", {"t": tenant})
    kid_rule = UniqueRule("base_key", "public.kid", ("tenant_id", "k"))
    assert len(check_rule(conn, kid_rule).groups) == 1
    assert remaining_conflicts(conn, rule) == {"unclassified": 1}, "the child's report is its own"
    assert len(check_rule(conn, rule).groups) == 1
    assert resolve_rule(conn, rule).quarantined == 1
    assert remaining_conflicts(conn, rule) == {}
    kids = conn.execute("SELECT count(*) AS n FROM ONLY public.kid").fetchone()
    assert kids == {"n": 2}, "the child's rows are its own rule's business"
    conn.execute("CREATE UNIQUE INDEX base_key ON public.base (tenant_id, k)")


def test_the_report_works_before_the_migration_that_keys_it_by_table(
    conn: psycopg.Connection[Row],
) -> None:
    """`payhook uniqueness` runs before `migrate`, perhaps with 0007 pending."""
    conn.execute(
        "ALTER TABLE payhook.uniqueness_conflicts DROP CONSTRAINT uniqueness_conflicts_pkey,"
        " ADD CONSTRAINT uniqueness_conflicts_pkey PRIMARY KEY (tenant_id, rule, key)"
    )
    add_exception(conn, "evt_twice")
    add_exception(conn, "evt_twice")
    assert check_rule(conn, EXCEPTIONS_RULE).summary()["redelivery"] == 1
    assert check_rule(conn, EXCEPTIONS_RULE).summary()["redelivery"] == 1, "checked again"
    assert resolve_rule(conn, EXCEPTIONS_RULE).quarantined == 1
    assert remaining_conflicts(conn, EXCEPTIONS_RULE) == {}


def test_a_rule_without_a_name_is_read_under_the_name_postgresql_gives_it(
    conn: psycopg.Connection[Row],
) -> None:
    long = "t" * 40
    statements = [
        "ALTER TABLE public.named ADD UNIQUE (tenant_id, k)",
        "ALTER TABLE public.named ADD PRIMARY KEY (tenant_id, id)",
        "CREATE UNIQUE INDEX ON public.named (tenant_id, id, k)",
        "CREATE UNIQUE INDEX ON public.named (tenant_id, k) INCLUDE (id) WHERE k <> ''",
        "ALTER TABLE public.named ADD UNIQUE (tenant_id, id) INCLUDE (k)",
        "CREATE UNIQUE INDEX ON public.named (tenant_id, k, k)",
        f"ALTER TABLE public.{long} ADD UNIQUE (tenant_id, {'c' * 40})",
        f'CREATE UNIQUE INDEX "{"N" * 70}" ON public.named (tenant_id, k)',
    ]
    conn.execute("CREATE TABLE public.named (tenant_id uuid NOT NULL, id int NOT NULL, k text)")
    conn.execute(f"CREATE TABLE public.{long} (tenant_id uuid, {'c' * 40} text)")
    for statement in statements:
        before = {r["relname"] for r in conn.execute("SELECT relname FROM pg_class").fetchall()}
        conn.execute(statement)
        after = {r["relname"] for r in conn.execute("SELECT relname FROM pg_class").fetchall()}
        (made,) = after - before
        (rule,) = rules_in(statement + ";")
        assert rule.name == made, statement


def test_names_given_on_the_command_line_are_read_as_identifiers(
    conn: psycopg.Connection[Row], database: str
) -> None:
    """`--rule Split_Key` is the rule `migrate` reads as split_key."""
    tenant = str(uuid.uuid4())
    conn.execute("CREATE TABLE public.cli (tenant_id uuid NOT NULL, k text, seen timestamptz)")
    conn.execute(
        "INSERT INTO public.cli VALUES (%(t)s, 'x', now()), (%(t)s, 'x', now() - interval '1 h')",
        {"t": tenant},
    )
    result = run_cli(
        test_settings(database),
        "uniqueness", "check", "--rule", "Cli_Key", "--table", "Public.Cli",
        "--columns", "Tenant_Id, K", "--ignore", "Seen",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["redelivery"] == 1
    rule = UniqueRule("cli_key", "public.cli", ("tenant_id", "k"))
    assert remaining_conflicts(conn, rule) == {"redelivery": 1}
