"""Unique rules on live tables while other sessions run: long readers, racing deletes,
other time zones, natural keys, and rules that pending migrations create."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from control import migrations, uniqueness, uniqueness_command
from control.migrations import InvalidIndexLeft, apply_migrations, list_migrations
from control.unique_rules import RuleError, UniqueRule
from control.uniqueness import check_rule, remaining_conflicts, resolve_rule
from payhook.db import Row, connect, fetch_one
from payhook.errors import MigrationError
from payhook.settings import Settings
from tests.conftest import test_settings
from tests.integration.test_uniqueness import (
    EXCEPTIONS_RULE,
    RULE,
    RULE_MIGRATION,
    TENANT,
    add_exception,
    folder_with,
    index_state,
)
from tests.processes import run_cli


def wait_for(conn: psycopg.Connection[Row], condition: str, timeout: float = 20) -> dict[str, Any]:
    """The first session of the migration runner that matches `condition`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute(
            sql.SQL(
                "SELECT pid, query FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'payhook-migrate' AND {}"
            ).format(sql.SQL(condition))
        ).fetchone()
        if row is not None:
            return row
        time.sleep(0.02)
    raise AssertionError(f"no migration session with {condition}")


def in_thread(action: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """`action` started in a thread; its result or exception lands in the list."""
    results: list[object] = []

    def run() -> None:
        try:
            results.append(action())
        except Exception as exc:
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


def test_a_concurrent_build_waits_for_a_long_reader_instead_of_timing_out(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    """A report holding a snapshot blocks no writer, so the build waits for it
    rather than failing on lock_timeout after building the whole index."""
    folder = folder_with(tmp_path, "exceptions_event_kind_key", RULE_MIGRATION)
    add_exception(conn, "evt_1")
    with connect(settings, "report", owner=True) as report, report.transaction():
        report.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        report.execute("SELECT count(*) FROM payhook.tenants")  # not the indexed table
        thread, results = in_thread(
            lambda: apply_migrations(settings, folder, lock_timeout="200ms", lock_attempts=1)
        )
        wait_for(conn, "query LIKE 'CREATE UNIQUE INDEX CONCURRENTLY%%'")
        time.sleep(0.6)  # three lock timeouts
        add_exception(conn, "evt_2")  # writers go on meanwhile
    thread.join(timeout=30)
    assert len(results) == 1 and isinstance(results[0], list), results
    assert index_state(conn) == {"valid": True, "constrained": True}


def test_lock_timeout_still_applies_to_ddl_after_a_concurrent_build(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    """The build's own lock timeout is put back for the statements after it; were it
    not, the ALTER TABLE would wait out the statement timeout of a few seconds."""
    text = (
        "-- payhook: no-transaction\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS exceptions_kind ON payhook.payment_exceptions"
        " (kind);\nALTER TABLE payhook.payment_exceptions ADD COLUMN note text;\n"
    )
    folder = folder_with(tmp_path, "exceptions_note", text)
    with connect(settings, "reader", owner=True) as reader, reader.transaction():
        reader.execute("SELECT count(*) FROM payhook.payment_exceptions")
        with pytest.raises(MigrationError, match="no lock within lock_timeout in 1 tries"):
            apply_migrations(
                settings, folder, lock_timeout="200ms", lock_attempts=1, statement_timeout="5s"
            )


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Statements and drops cancelled after half a second, and retries 0.2 s apart."""
    monkeypatch.setattr(migrations, "STATEMENT_TIMEOUT", "500ms")
    monkeypatch.setattr(migrations, "INVALID_INDEX_DROP_TIMEOUT", 0.5)
    monkeypatch.setattr(migrations, "LOCK_RETRY_DELAY", 0.2)


@pytest.mark.usefixtures("quick_retries")
def test_an_invalid_unique_index_that_cannot_be_dropped_stops_the_run_saying_so(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    """A pg_dump of the table holds the build (cancelled) and then its drop: the
    invalid index still refuses writes, and the error says so and how to drop it."""
    folder = folder_with(tmp_path, "exceptions_event_kind_key", RULE_MIGRATION)
    add_exception(conn, "evt_1")
    with connect(settings, "dump", owner=True) as dump, dump.transaction():
        dump.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        dump.execute("SELECT count(*) FROM payhook.payment_exceptions")
        with pytest.raises(InvalidIndexLeft) as error:
            apply_migrations(settings, folder, lock_attempts=2)
    message = str(error.value)
    assert "could not be dropped in 2 tries" in message
    assert "it still enforces its unique rule on live writes" in message
    assert f'DROP INDEX CONCURRENTLY IF EXISTS "payhook"."{RULE}";' in message
    assert index_state(conn) == {"valid": False, "constrained": False}
    with pytest.raises(psycopg.errors.UniqueViolation):
        add_exception(conn, "evt_1")  # as the message says
    apply_migrations(settings, folder)  # the reader gone: dropped, then built
    assert index_state(conn) == {"valid": True, "constrained": True}


@pytest.mark.usefixtures("quick_retries")
def test_the_drop_of_an_invalid_index_is_tried_again_until_it_goes(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    folder = folder_with(tmp_path, "exceptions_event_kind_key", RULE_MIGRATION)
    add_exception(conn, "evt_1")
    with connect(settings, "dump", owner=True) as dump, dump.transaction():
        dump.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        dump.execute("SELECT count(*) FROM payhook.payment_exceptions")
        thread, results = in_thread(lambda: apply_migrations(settings, folder, lock_attempts=5))
        wait_for(conn, "query LIKE 'DROP INDEX CONCURRENTLY%%'")
        time.sleep(0.6)  # the first drop is cancelled
    thread.join(timeout=30)
    assert len(results) == 1 and isinstance(results[0], MigrationError), results
    assert not isinstance(results[0], InvalidIndexLeft), results
    assert "statement timeout" in str(results[0]), "the build's own failure is reported"
    assert index_state(conn) is None
    add_exception(conn, "evt_1")  # a consumer's write is not refused


def test_a_group_that_lost_a_copy_between_the_two_statements_is_not_recorded(
    conn: psycopg.Connection[Row], settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another session deletes a copy after the groups are found, before they are compared."""
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_1")
    template = uniqueness._template

    def racing(name: str, parts: dict[str, sql.Composable]) -> sql.Composed:
        if name == "compare_conflicts":
            with connect(settings, "other-operator", owner=True) as other:
                other.execute(
                    "DELETE FROM payhook.payment_exceptions"
                    " WHERE id = (SELECT max(id) FROM payhook.payment_exceptions)"
                )
        return template(name, parts)

    monkeypatch.setattr(uniqueness, "_template", racing)
    report = check_rule(conn, EXCEPTIONS_RULE)
    assert report.groups == []
    assert conn.execute("SELECT count(*) AS n FROM payhook.uniqueness_conflicts").fetchone() == {
        "n": 0
    }


KIND_AT = UniqueRule(
    "exc_kind_at", "payhook.payment_exceptions", ("tenant_id", "kind", "created_at")
)


def two_copies_at_one_instant(conn: psycopg.Connection[Row]) -> None:
    with conn.transaction():  # one now(): the same created_at
        add_exception(conn, "evt_1")
        add_exception(conn, "evt_1")


def test_a_timestamp_key_checked_in_one_time_zone_is_resolved_from_another(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    two_copies_at_one_instant(conn)
    with connect(settings, "op-utc", options="-c TimeZone=UTC", owner=True) as utc:
        assert check_rule(utc, KIND_AT).summary()["redelivery"] == 1
    with connect(settings, "op-paris", options="-c TimeZone=Europe/Paris", owner=True) as paris:
        resolved = resolve_rule(paris, KIND_AT)
        assert remaining_conflicts(paris, KIND_AT) == {}
    assert (resolved.collapsed, resolved.quarantined) == (1, 1)


def test_a_group_whose_key_matches_no_row_is_left_open_while_its_rows_remain(
    conn: psycopg.Connection[Row],
) -> None:
    """A stored key that reads differently from the rows' (another rendering of the
    same instant) is not settled as gone: the rows are counted by their columns."""
    two_copies_at_one_instant(conn)
    check_rule(conn, KIND_AT)
    conn.execute(
        "UPDATE payhook.uniqueness_conflicts SET key = jsonb_set(key, '{created_at}',"
        " to_jsonb(to_char((key->>'created_at')::timestamptz AT TIME ZONE 'Asia/Tokyo',"
        " 'YYYY-MM-DD\"T\"HH24:MI:SS.US') || '+09:00'))"
    )
    resolved = resolve_rule(conn, KIND_AT)
    assert (resolved.quarantined, resolved.unmatched) == (0, 1)
    still_open = conn.execute(
        "SELECT count(*) AS n FROM payhook.uniqueness_conflicts WHERE resolved_at IS NULL"
    ).fetchone()
    assert still_open == {"n": 1}
    assert conn.execute("SELECT count(*) AS n FROM payhook.payment_exceptions").fetchone() == {
        "n": 2
    }


def test_a_group_whose_rows_are_gone_is_settled(conn: psycopg.Connection[Row]) -> None:
    two_copies_at_one_instant(conn)
    check_rule(conn, KIND_AT)
    conn.execute("DELETE FROM payhook.payment_exceptions")
    resolved = resolve_rule(conn, KIND_AT)
    assert (resolved.collapsed, resolved.unmatched) == (0, 0)
    assert conn.execute(
        "SELECT count(*) AS n FROM payhook.uniqueness_conflicts WHERE resolved_at IS NULL"
    ).fetchone() == {"n": 0}


@pytest.fixture
def refunds(conn: psycopg.Connection[Row]) -> UniqueRule:
    """Two partial refunds of one order, told apart only by their natural key."""
    conn.execute(
        "CREATE TABLE public.refunds (tenant_id uuid NOT NULL, refund_id text NOT NULL,"
        " order_ref text NOT NULL, amount_minor int NOT NULL,"
        " PRIMARY KEY (tenant_id, refund_id))"
    )
    conn.execute(
        "INSERT INTO public.refunds VALUES"
        " (%s, 're_1', 'order-1', 500), (%s, 're_2', 'order-1', 500)",
        (TENANT, TENANT),
    )
    return UniqueRule("refunds_order_key", "public.refunds", ("tenant_id", "order_ref"))


def test_rows_that_differ_in_a_natural_primary_key_are_distinct_and_kept(
    conn: psycopg.Connection[Row], refunds: UniqueRule
) -> None:
    summary = check_rule(conn, refunds).summary()
    assert (summary["ignored"], summary["distinct"], summary["redelivery"]) == ([], 1, 0)
    assert resolve_rule(conn, refunds).quarantined == 0
    left = conn.execute("SELECT refund_id FROM public.refunds ORDER BY refund_id").fetchall()
    assert [r["refund_id"] for r in left] == ["re_1", "re_2"]
    named = check_rule(conn, refunds, ("refund_id",)).summary()
    assert (named["ignored"], named["redelivery"]) == (["refund_id"], 1), "only when named"


def test_a_primary_key_the_database_generates_is_ignored(conn: psycopg.Connection[Row]) -> None:
    conn.execute(
        "CREATE TABLE public.notes (id uuid PRIMARY KEY DEFAULT gen_random_uuid(),"
        " serial_no bigserial, tenant_id uuid NOT NULL, ref text NOT NULL, body text)"
    )
    conn.execute(
        "INSERT INTO public.notes (tenant_id, ref, body) VALUES (%s, 'r', 'b'), (%s, 'r', 'b')",
        (TENANT, TENANT),
    )
    rule = UniqueRule("notes_ref_key", "public.notes", ("tenant_id", "ref"))
    summary = check_rule(conn, rule).summary()
    assert (summary["ignored"], summary["redelivery"]) == (["id", "serial_no"], 1)


ADD_COLUMN_RULE = """-- payhook: no-transaction
ALTER TABLE payhook.payment_exceptions
    ADD COLUMN IF NOT EXISTS source text NOT NULL DEFAULT 'gateway';
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS payment_exceptions_source_key
    ON payhook.payment_exceptions (tenant_id, event_id, kind, source);
"""
NEW_TABLE_RULE = """CREATE TABLE payhook.refund_requests (tenant_id uuid, ref text NOT NULL);
CREATE UNIQUE INDEX refund_requests_ref_key ON payhook.refund_requests (tenant_id, ref);
CREATE UNIQUE INDEX refund_requests_lower_key ON payhook.refund_requests (tenant_id, lower(ref));
"""


def run_check(
    settings: Settings, capsys: pytest.CaptureFixture[str], rule: str | None = None
) -> tuple[int, list[str]]:
    """`payhook uniqueness check [--rule RULE]`: its exit status and the JSON lines it printed."""
    args = argparse.Namespace(action="check", rule=rule, table=None, columns=None, ignore=None)
    status = uniqueness_command.run(args, settings)
    return status, [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_the_check_skips_rules_that_pending_migrations_create_and_checks_the_rest(
    conn: psycopg.Connection[Row],
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = folder_with(tmp_path, "exceptions_source_key", ADD_COLUMN_RULE)
    version = len(list_migrations(folder))
    (folder / f"{version + 1:04d}_refund_requests.sql").write_text(NEW_TABLE_RULE)
    (folder / f"{version + 2:04d}_exceptions_event_kind_key.sql").write_text(RULE_MIGRATION)
    monkeypatch.setattr(migrations, "migrations_dir", lambda: folder)
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_1")

    status, lines = run_check(settings, capsys)

    skipped = "created by the migration: the build is the check"
    assert lines[:2] == [
        f'{{"rule": "payment_exceptions_source_key", "skipped": "{skipped}"}}',
        f'{{"rule": "refund_requests_ref_key", "skipped": "{skipped}"}}',
    ]
    unchecked = json.loads(lines[2])
    assert unchecked["rule"] == "refund_requests_lower_key"
    assert unchecked["skipped"].startswith("cannot be checked: cannot read the unique rule")
    assert "lower(ref)" in unchecked["skipped"]
    assert len(lines) == 4 and f'"rule": "{RULE}"' in lines[3] and '"groups": 1' in lines[3]
    assert status == 1


def test_a_pending_rule_named_in_upper_case_is_the_rule(
    conn: psycopg.Connection[Row],
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--rule` is read as SQL reads a name: unquoted, it is folded."""
    folder = folder_with(tmp_path, "exceptions_event_kind_key", RULE_MIGRATION)
    monkeypatch.setattr(migrations, "migrations_dir", lambda: folder)
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_1")
    status, (line,) = run_check(settings, capsys, rule=RULE.upper())
    assert status == 1
    assert json.loads(line)["rule"] == RULE and json.loads(line)["redelivery"] == 1


def test_naming_a_rule_that_cannot_be_checked_says_so_and_why(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = folder_with(tmp_path, "refund_requests", NEW_TABLE_RULE)
    monkeypatch.setattr(migrations, "migrations_dir", lambda: folder)
    args = argparse.Namespace(
        action="check", rule="refund_requests_lower_key", table=None, columns=None, ignore=None
    )
    with pytest.raises(
        RuleError,
        match=r"--rule refund_requests_lower_key: cannot be checked: .*lower\(ref\)",
    ):
        uniqueness_command.run(args, settings)


def test_a_rule_named_with_its_table_that_does_not_exist_is_still_an_error(
    settings: Settings,
) -> None:
    args = argparse.Namespace(
        action="check", rule="x_key", table="payhook.nope", columns="tenant_id", ignore=None
    )
    with pytest.raises(uniqueness.NotYetThere, match=r"no table payhook\.nope"):
        uniqueness_command.run(args, settings)


def test_a_trailing_comment_does_not_glue_two_concurrent_builds_together(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    text = """-- payhook: no-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_a ON payhook.payment_outbox (created_at); -- alert
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_b ON payhook.payment_outbox (delivered_at);
"""
    folder = folder_with(tmp_path, "two_indexes", text)
    assert len(apply_migrations(settings, folder)) == 1
    names = conn.execute(
        "SELECT relname FROM pg_class WHERE relname IN ('outbox_a', 'outbox_b') ORDER BY 1"
    ).fetchall()
    assert [r["relname"] for r in names] == ["outbox_a", "outbox_b"]


def test_a_unique_rule_after_a_trailing_comment_is_checked_before_it_is_built(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> None:
    text = RULE_MIGRATION.replace(
        "-- One exception per event and kind.",
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS exceptions_kind"
        " ON payhook.payment_exceptions (kind); -- for the alert",
    )
    folder = folder_with(tmp_path, "exceptions_event_kind_key", text)
    add_exception(conn, "evt_1")
    add_exception(conn, "evt_1")
    with pytest.raises(uniqueness.UnresolvedConflicts, match="1 not classified yet"):
        apply_migrations(settings, folder)


def test_commands_run_from_different_time_zones_agree_on_timestamp_keys(
    conn: psycopg.Connection[Row], database: str
) -> None:
    """`payhook uniqueness` pins its session: PGTZ on one host, another on the next."""
    two_copies_at_one_instant(conn)
    rule = ["--rule", KIND_AT.name, "--table", KIND_AT.table]
    rule += ["--columns", "tenant_id,kind,created_at"]
    check = run_cli(test_settings(database), "uniqueness", "check", *rule, PGTZ="Asia/Tokyo")
    assert check.returncode == 1, check.stderr
    stored = conn.execute("SELECT key->>'created_at' AS at FROM payhook.uniqueness_conflicts")
    assert [r["at"][-6:] for r in stored.fetchall()] == ["+00:00"]
    resolve = run_cli(test_settings(database), "uniqueness", "resolve", *rule, PGTZ="America/Lima")
    assert resolve.returncode == 0, resolve.stdout + resolve.stderr
    assert '"quarantined": 1' in resolve.stdout


def test_resolve_does_not_trust_a_natural_key_an_older_report_left_out(
    conn: psycopg.Connection[Row], refunds: UniqueRule
) -> None:
    """A report an older check wrote, which left out every primary-key column,
    calls two partial refunds a redelivery: resolve compares refund_id again."""
    conn.execute(
        "INSERT INTO payhook.uniqueness_conflicts (tenant_id, rule, table_name, key, copies,"
        " versions, classification, ignored) VALUES (%s, %s, %s, %s, 2, 1, 'redelivery',"
        " ARRAY['refund_id'])",
        (TENANT, refunds.name, refunds.table, '{"order_ref": "order-1"}'),
    )
    resolved = resolve_rule(conn, refunds)
    assert (resolved.quarantined, resolved.reclassified) == (0, 1)
    left = conn.execute("SELECT refund_id FROM public.refunds ORDER BY refund_id").fetchall()
    assert [r["refund_id"] for r in left] == ["re_1", "re_2"]
    report = conn.execute(
        "SELECT classification, ignored FROM payhook.uniqueness_conflicts"
    ).fetchone()
    assert report == {"classification": "distinct", "ignored": []}


def test_resolve_keeps_a_natural_key_the_operator_named(
    conn: psycopg.Connection[Row], refunds: UniqueRule
) -> None:
    check_rule(conn, refunds, ("refund_id",))
    stored = conn.execute("SELECT ignored FROM payhook.uniqueness_conflicts").fetchone()
    assert stored == {"ignored": ["--ignore=refund_id"]}
    assert resolve_rule(conn, refunds).quarantined == 1
    left = conn.execute("SELECT refund_id FROM public.refunds").fetchall()
    assert [r["refund_id"] for r in left] == ["re_1"]


def test_a_group_of_a_table_with_a_not_null_domain_is_counted_by_its_key_columns(
    conn: psycopg.Connection[Row],
) -> None:
    """Only the key's columns are read back from the report: a NOT NULL domain
    column elsewhere in the table would refuse the nulls of a whole-row read."""
    conn.execute("CREATE DOMAIN public.amount AS int NOT NULL CHECK (VALUE > 0)")
    conn.execute(
        "CREATE TABLE public.charges (id bigserial PRIMARY KEY, tenant_id uuid NOT NULL,"
        " at timestamptz NOT NULL, amount public.amount)"
    )
    conn.execute(
        "INSERT INTO public.charges (tenant_id, at, amount) VALUES"
        " (%s, '2026-01-02 03:04:05+00', 5), (%s, '2026-01-02 03:04:05+00', 5)",
        (TENANT, TENANT),
    )
    rule = UniqueRule("charges_at_key", "public.charges", ("tenant_id", "at"))
    assert check_rule(conn, rule).summary()["redelivery"] == 1
    conn.execute(  # the same instant, written another way: no row matches it as text
        'UPDATE payhook.uniqueness_conflicts SET key = \'{"at": "2026-01-02T12:04:05+09:00"}\''
    )
    resolved = resolve_rule(conn, rule)
    assert (resolved.quarantined, resolved.unmatched) == (0, 1)
    assert conn.execute("SELECT count(*) AS n FROM public.charges").fetchone() == {"n": 2}


def test_a_numeric_key_keeps_every_digit_from_check_to_resolve(
    conn: psycopg.Connection[Row],
) -> None:
    conn.execute(
        "CREATE TABLE public.ledger (id bigserial PRIMARY KEY, tenant_id uuid NOT NULL,"
        " amount numeric(30, 10) NOT NULL, memo text)"
    )
    conn.execute(
        "INSERT INTO public.ledger (tenant_id, amount, memo) VALUES"
        " (%s, 12345678901234567890.1234567891, 'm'), (%s, 12345678901234567890.1234567891, 'm')",
        (TENANT, TENANT),
    )
    rule = UniqueRule("ledger_amount_key", "public.ledger", ("tenant_id", "amount"))
    summary = check_rule(conn, rule).summary()
    assert (summary["groups"], summary["redelivery"]) == (1, 1)
    stored = conn.execute("SELECT key::text AS key FROM payhook.uniqueness_conflicts").fetchone()
    assert stored == {"key": '{"amount": 12345678901234567890.1234567891}'}
    resolved = resolve_rule(conn, rule)
    assert (resolved.quarantined, resolved.unmatched) == (1, 0)
    assert remaining_conflicts(conn, rule) == {}


#: A unique rule the pre-check cannot read, so rows that break it reach the build.
LOWER_RULE = """-- payhook: no-transaction
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS exceptions_lower_key
    ON payhook.payment_exceptions (tenant_id, lower(event_id));
"""


def failing_build_held_by_a_reader(
    conn: psycopg.Connection[Row], settings: Settings, tmp_path: Path
) -> tuple[Path, psycopg.Connection[Row]]:
    """A migration whose build fails on duplicates, and a reader of the table
    (open transaction) that the drop of the invalid index waits for."""
    folder = folder_with(tmp_path, "exceptions_lower_key", LOWER_RULE)
    add_exception(conn, "evt_1")
    add_exception(conn, "EVT_1")
    reader = connect(settings, "reader", owner=True)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM payhook.payment_exceptions")
    return folder, reader


def test_the_drop_after_a_failed_build_has_its_own_short_time(
    conn: psycopg.Connection[Row],
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not the statement timeout: each drop gives up after its own budget."""
    monkeypatch.setattr(migrations, "INVALID_INDEX_DROP_TIMEOUT", 0.3)
    monkeypatch.setattr(migrations, "LOCK_RETRY_DELAY", 0.05)
    folder, reader = failing_build_held_by_a_reader(conn, settings, tmp_path)
    with reader:
        started = time.monotonic()
        with pytest.raises(InvalidIndexLeft, match="could not be dropped in 2 tries"):
            apply_migrations(settings, folder, lock_attempts=2, statement_timeout="5s")
        assert time.monotonic() - started < 4
    with pytest.raises(MigrationError, match="is duplicated"):
        apply_migrations(settings, folder, lock_attempts=2)  # the reader gone
    assert fetch_state(conn, "exceptions_lower_key") is None, "dropped after the build"


def test_an_operator_cancelling_the_drop_is_not_overridden_by_a_retry(
    conn: psycopg.Connection[Row],
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(migrations, "INVALID_INDEX_DROP_TIMEOUT", 20.0)
    monkeypatch.setattr(migrations, "LOCK_RETRY_DELAY", 0.05)
    folder, reader = failing_build_held_by_a_reader(conn, settings, tmp_path)
    with reader:
        thread, results = in_thread(
            lambda: apply_migrations(settings, folder, lock_attempts=5, statement_timeout="30s")
        )
        drop = wait_for(conn, "query LIKE 'DROP INDEX CONCURRENTLY%%' AND state = 'active'")
        conn.execute("SELECT pg_cancel_backend(%s)", (drop["pid"],))
        thread.join(timeout=10)
        assert len(results) == 1 and isinstance(results[0], InvalidIndexLeft), results
    assert "could not be dropped in 1 tries" in str(results[0])
    assert "canceling statement due to user request" in str(results[0])
    state = fetch_state(conn, "exceptions_lower_key")
    assert state is not None and (state["valid"], state["is_unique"]) == (False, True)


def fetch_state(conn: psycopg.Connection[Row], index: str) -> Row | None:
    return fetch_one(conn, "index_state", {"table": "payhook.payment_exceptions", "index": index})
