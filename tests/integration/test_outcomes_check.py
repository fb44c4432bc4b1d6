"""The start-up check: the schema's CHECK constraints list payhook's outcomes and kinds."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator

import psycopg
import pytest
from psycopg import sql
from structlog.testing import capture_logs

from consumer import main as consumer_main
from control import dashboard
from payhook.db import Row, connect, create_pool
from payhook.errors import OutcomesMismatch
from payhook.outcomes import ANOMALY_KINDS, EXCEPTION_KINDS, RECEIPT_OUTCOMES, check_outcomes
from payhook.settings import Settings
from tests.conftest import PG_SERVER
from tests.factories import TEST_KEYRING
from tests.processes import run_cli


def replace_check(
    conn: psycopg.Connection[Row], table: str, column: str, name: str, names: Iterable[str]
) -> None:
    """Put a CHECK listing `names` on `table.column` in place of `name`, as a migration would."""
    conn.execute(
        sql.SQL(
            "ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {name},"
            " ADD CONSTRAINT {name} CHECK ({column} IN ({names}))"
        ).format(
            table=sql.Identifier("payhook", table),
            name=sql.Identifier(name),
            column=sql.Identifier(column),
            names=sql.SQL(", ").join(sql.Literal(n) for n in sorted(names)),
        )
    )


def add_receipt_outcome(conn: psycopg.Connection[Row], outcome: str) -> None:
    replace_check(
        conn,
        "payment_event_receipts",
        "outcome",
        "payment_event_receipts_outcome_check",
        {*RECEIPT_OUTCOMES, outcome},
    )


def test_the_migrated_schema_lists_payhooks_outcomes_and_kinds(
    conn: psycopg.Connection[Row],
) -> None:
    check_outcomes(conn)


def test_a_receipt_outcome_only_the_database_has_fails_naming_both_lists(
    conn: psycopg.Connection[Row],
) -> None:
    add_receipt_outcome(conn, "refund_pending")
    with pytest.raises(OutcomesMismatch) as raised:
        check_outcomes(conn)
    in_database = ", ".join(sorted({*RECEIPT_OUTCOMES, "refund_pending"}))
    in_payhook = ", ".join(sorted(RECEIPT_OUTCOMES))
    assert str(raised.value) == (
        "payhook.payment_event_receipts.outcome: the database's CHECK "
        f"payment_event_receipts_outcome_check lists [{in_database}], "
        f"payhook.outcomes.RECEIPT_OUTCOMES lists [{in_payhook}]: "
        "only the database has [refund_pending]"
    )


def test_an_anomaly_kind_the_database_lacks_fails(conn: psycopg.Connection[Row]) -> None:
    replace_check(
        conn,
        "security_anomalies",
        "kind",
        "security_anomalies_kind_check",
        set(ANOMALY_KINDS) - {"malformed_job"},
    )
    with pytest.raises(OutcomesMismatch, match=r"only payhook has \[malformed_job\]$") as raised:
        check_outcomes(conn)
    assert str(raised.value).startswith("payhook.security_anomalies.kind: the database's CHECK")


def test_every_difference_is_named_in_one_message(conn: psycopg.Connection[Row]) -> None:
    add_receipt_outcome(conn, "refund_pending")
    conn.execute(
        "ALTER TABLE payhook.security_anomalies DROP CONSTRAINT security_anomalies_kind_check"
    )
    with pytest.raises(OutcomesMismatch) as raised:
        check_outcomes(conn)
    receipts, anomalies = str(raised.value).split("; ")
    assert receipts.endswith("only the database has [refund_pending]")
    assert anomalies.startswith(
        "payhook.security_anomalies.kind: no CHECK constraint lists its names, "
        "payhook.outcomes.ANOMALY_KINDS lists [digest_conflict, "
    )
    assert anomalies.endswith("]: run `payhook migrate`")


def test_an_exception_kinds_check_is_held_to_payhooks_list_once_there_is_one(
    conn: psycopg.Connection[Row],
) -> None:
    """The schema has none today; one a later migration adds must list the kinds."""
    name = "payment_exceptions_kind_check"
    replace_check(conn, "payment_exceptions", "kind", name, EXCEPTION_KINDS)
    check_outcomes(conn)
    replace_check(conn, "payment_exceptions", "kind", name, {*EXCEPTION_KINDS, "chargeback_lost"})
    with pytest.raises(OutcomesMismatch, match=r"only the database has \[chargeback_lost\]$"):
        check_outcomes(conn)


def test_a_check_that_is_not_a_list_of_names_fails(conn: psycopg.Connection[Row]) -> None:
    conn.execute(
        "ALTER TABLE payhook.security_anomalies"
        " ADD CONSTRAINT kind_not_empty CHECK (kind <> '') NOT VALID"
    )
    with pytest.raises(
        OutcomesMismatch,
        match=r"^payhook.security_anomalies.kind: its CHECK kind_not_empty is not a list of names",
    ):
        check_outcomes(conn)


def test_a_check_added_not_valid_is_read_like_any_other(conn: psycopg.Connection[Row]) -> None:
    """Migrations 0003 and 0005 add the receipts' check NOT VALID, then validate it."""
    conn.execute(
        sql.SQL(
            "ALTER TABLE payhook.payment_event_receipts"
            " DROP CONSTRAINT payment_event_receipts_outcome_check,"
            " ADD CONSTRAINT payment_event_receipts_outcome_check"
            " CHECK (outcome IN ({})) NOT VALID"
        ).format(sql.SQL(", ").join(sql.Literal(n) for n in RECEIPT_OUTCOMES))
    )
    check_outcomes(conn)


@pytest.fixture
def unprivileged(settings: Settings) -> Iterator[Settings]:
    """Settings for a role that may log in but read nothing of the schema."""
    role = f"payhook_test_outcomes_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    url = PG_SERVER.replace("//postgres@", f"//{role}@", 1)
    database = psycopg.conninfo.conninfo_to_dict(settings.database_url)["dbname"]
    yield Settings.from_env({"DATABASE_URL": f"{url}/{database}"})
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_a_role_without_grants_on_the_schema_can_run_the_check(unprivileged: Settings) -> None:
    """It reads only the catalog: a deploy with broken grants starts, and its
    jobs fail where an operator sees them."""
    with connect(unprivileged, "test", owner=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT 1 FROM payhook.payment_event_receipts LIMIT 1")
        check_outcomes(conn)


def test_payhook_migrate_fails_on_a_schema_that_differs(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    assert run_cli(settings, "migrate").returncode == 0
    add_receipt_outcome(conn, "refund_pending")
    migrate = run_cli(settings, "migrate")
    assert migrate.returncode == 2, migrate.stderr
    assert migrate.stdout == ""
    assert migrate.stderr.startswith(
        "payhook: error: payhook.payment_event_receipts.outcome: the database's CHECK"
    )
    assert migrate.stderr.rstrip().endswith("only the database has [refund_pending]")


def test_a_consumer_does_not_start_on_a_schema_that_differs(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    add_receipt_outcome(conn, "refund_pending")
    consumer = run_cli(settings, "consumer", "--burst")
    assert consumer.returncode == 2, consumer.stderr
    assert "payhook: error: payhook.payment_event_receipts.outcome: the database's CHECK" in (
        consumer.stderr
    )
    assert '"consumer_started"' not in consumer.stdout


def test_a_consumer_waits_for_postgresql_before_it_checks(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[None] = []

    def unreachable_once(conn: psycopg.Connection[Row]) -> None:
        calls.append(None)
        if len(calls) == 1:
            raise psycopg.OperationalError("connection refused")
        check_outcomes(conn)

    monkeypatch.setattr(consumer_main, "check_outcomes", unreachable_once)
    monkeypatch.setattr(consumer_main, "CHECK_RETRY_DELAY", 0.0)
    pool = create_pool(settings, "test", size=1)
    pool.open(wait=True)
    try:
        with capture_logs() as logs:
            consumer_main.check_schema(pool, TEST_KEYRING)
    finally:
        pool.close()
    assert len(calls) == 2
    assert [e["event"] for e in logs] == ["outcomes_check_waiting"]
    assert logs[0]["error"] == "OperationalError"


def test_the_dashboard_does_not_start_on_a_schema_that_differs(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    add_receipt_outcome(conn, "refund_pending")
    with pytest.raises(OutcomesMismatch, match=r"only the database has \[refund_pending\]$"):
        dashboard.check_schema(settings)
    board = run_cli(settings, "dashboard", "--port", "39181")
    assert board.returncode == 2, board.stderr
    assert "payhook: error: payhook.payment_event_receipts.outcome" in board.stderr


def test_the_dashboard_starts_while_postgresql_cannot_answer() -> None:
    """Its queues are in Redis; an outage is when an operator needs them."""
    down = Settings.from_env({"DATABASE_URL": "postgresql://postgres@127.0.0.1:1/payhook"})
    with capture_logs() as logs:
        dashboard.check_schema(down)
    assert [(e["event"], e["log_level"]) for e in logs] == [("outcomes_unchecked", "warning")]
