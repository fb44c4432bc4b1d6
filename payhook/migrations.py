"""Forward-only migrations from `sql/migrations/NNNN_name.sql`.

`apply_migrations` takes a session advisory lock, so any number of processes
may run it at once: one applies, the others wait and then find nothing to do.
Each file runs in its own transaction and is recorded in
`payhook.schema_migrations` in that same transaction. A file whose first line
is `-- payhook: no-transaction` runs statement by statement outside a
transaction, for `CREATE INDEX CONCURRENTLY`; each of its statements must be
safe to run again (`IF NOT EXISTS`), since a failure leaves it unrecorded.

Live tables stay writable while a migration runs:

- DDL waits at most `LOCK_TIMEOUT` for a lock (consumers queue behind a
  waiting ALTER TABLE), then the statement, or the whole transactional file,
  is tried again a few times with backoff before the run gives up.
- An index that a `CREATE INDEX CONCURRENTLY` left invalid (it failed, or the
  process died) is dropped before the statement runs again and after it fails.
- A migration that adds a unique rule to a table that already exists is
  refused while rows of the table break the rule (`payhook.uniqueness`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import LiteralString, cast

import psycopg
import structlog
from psycopg import sql

from payhook.db import Row, connect, fetch_one
from payhook.errors import MigrationError
from payhook.queries import query, sql_root
from payhook.settings import Settings
from payhook.uniqueness import RuleError, require_no_conflicts, rules_in

log = structlog.get_logger(__name__)

#: Key of the advisory lock that serializes migration runs (any fixed bigint).
MIGRATION_LOCK_KEY = 0x7061796886F6F6B
#: How long DDL may wait for a lock before failing instead of stalling
#: consumers: while an ALTER TABLE waits, every writer of the table waits behind it.
LOCK_TIMEOUT = "2s"
#: Tries of a statement (or of a transactional file) that hit the lock timeout.
LOCK_ATTEMPTS = 5
#: Seconds before the second try; doubles with each try after it.
LOCK_RETRY_DELAY = 1.0
#: How long one migration statement may run.
STATEMENT_TIMEOUT = "15min"
#: Seconds between polls of the migration lock, doubling up to the maximum.
LOCK_POLL_MIN = 0.05
LOCK_POLL_MAX = 1.0
NO_TRANSACTION_MARKER = "-- payhook: no-transaction"

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_DOLLAR_QUOTE = re.compile(r"\$[A-Za-z_]*\$")
_CONCURRENT_INDEX = re.compile(
    r"^\s*CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)"
    r"\s+ON\s+(?:ONLY\s+)?(\w+(?:\.\w+)?)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path

    @property
    def transactional(self) -> bool:
        first = self.path.read_text().lstrip().splitlines()[:1]
        return first != [NO_TRANSACTION_MARKER]


def migrations_dir() -> Path:
    return sql_root() / "migrations"


def list_migrations(folder: Path | None = None) -> list[Migration]:
    """The migration files in order; names must be `NNNN_name.sql` and gapless from 0001."""
    folder = folder or migrations_dir()
    found: list[Migration] = []
    for path in sorted(folder.glob("*.sql")):
        match = _NAME.match(path.name)
        if match is None:
            raise MigrationError(f"{path.name}: migration names look like 0001_short_name.sql")
        found.append(Migration(int(match.group(1)), match.group(2), path))
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise MigrationError(
                f"{migration.path.name}: expected version {expected:04d}; versions must be gapless"
            )
    return found


def ensure_database(settings: Settings) -> bool:
    """Create the database named by DATABASE_URL when it is missing; True if created."""
    info = psycopg.conninfo.conninfo_to_dict(settings.database_url)
    dbname = str(info.get("dbname") or "")
    if not dbname:
        return False
    try:
        psycopg.connect(settings.database_url, connect_timeout=5).close()
        return False
    except psycopg.OperationalError as exc:
        if "does not exist" not in str(exc):
            raise
    admin = psycopg.conninfo.make_conninfo(settings.database_url, dbname="postgres")
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        except psycopg.errors.DuplicateDatabase:
            return False
        except psycopg.errors.UniqueViolation as exc:
            # Another process created it between our check and our CREATE.
            if exc.diag.constraint_name != "pg_database_datname_index":
                raise
            return False
    log.info("database_created", dbname=dbname)
    return True


def applied_versions(conn: psycopg.Connection[Row]) -> set[int]:
    rows = conn.execute(query("applied_migrations")).fetchall()
    return {int(cast(int, row["version"])) for row in rows}


def pending_migrations(settings: Settings, folder: Path | None = None) -> list[Migration]:
    """The migrations the database has not applied yet."""
    migrations = list_migrations(folder)
    with connect(settings, "migrate") as conn:
        present = fetch_one(conn, "table_exists", {"table": "payhook.schema_migrations"})
        done = applied_versions(conn) if present and present["present"] else set()
    return [m for m in migrations if m.version not in done]


def apply_migrations(
    settings: Settings,
    folder: Path | None = None,
    *,
    lock_timeout: str = LOCK_TIMEOUT,
    lock_attempts: int = LOCK_ATTEMPTS,
) -> list[str]:
    """Apply every pending migration; the names of those applied by this call."""
    migrations = list_migrations(folder)
    ensure_database(settings)
    applied: list[str] = []
    timeouts = f"-c lock_timeout={lock_timeout} -c statement_timeout={STATEMENT_TIMEOUT}"
    with connect(settings, "migrate", options=timeouts) as conn:
        _lock(conn)
        try:
            conn.execute(query("create_migrations_table"))
            done = applied_versions(conn)
            for migration in migrations:
                if migration.version in done:
                    continue
                _refuse_broken_unique_rules(conn, migration)
                _apply_one(conn, migration, lock_attempts)
                applied.append(migration.path.name)
                log.info("migration_applied", migration=migration.path.name)
        finally:
            conn.execute(query("unlock_migrations"), {"key": MIGRATION_LOCK_KEY})
    return applied


def _lock(conn: psycopg.Connection[dict[str, object]]) -> None:
    """Take the migration lock, polling so that waiting holds no snapshot."""
    delay = LOCK_POLL_MIN
    while True:
        row = conn.execute(query("try_lock_migrations"), {"key": MIGRATION_LOCK_KEY}).fetchone()
        if row is not None and row["locked"]:
            return
        time.sleep(delay)
        delay = min(delay * 2, LOCK_POLL_MAX)


def _refuse_broken_unique_rules(conn: psycopg.Connection[Row], migration: Migration) -> None:
    """Refuse a migration whose unique rule rows of an existing table already break."""
    try:
        for rule in rules_in(migration.path.read_text(), strict=False):
            try:
                require_no_conflicts(conn, rule)
            except psycopg.Error as exc:
                # The pre-check could not run on this table; the build is the check.
                log.warning("unique_rule_unchecked", rule=rule.name, reason=str(exc))
    except (RuleError, MigrationError) as exc:
        raise exc.__class__(f"{migration.path.name}: {exc}") from None


def _apply_one(conn: psycopg.Connection[Row], migration: Migration, attempts: int) -> None:
    text: LiteralString = migration.path.read_text()
    record = query("record_migration")
    params = {"version": migration.version, "name": migration.name}

    def whole_file() -> None:
        with conn.transaction():
            conn.execute(text)
            conn.execute(record, params)

    try:
        if migration.transactional:
            _retry_lock_timeouts(whole_file, attempts, migration)
        else:
            for statement in _split_statements(text):
                _retry_lock_timeouts(partial(_execute, conn, statement), attempts, migration)
            conn.execute(record, params)
    except psycopg.errors.LockNotAvailable as exc:
        raise MigrationError(
            f"{migration.path.name}: no lock within lock_timeout in {attempts} tries, "
            f"so consumers were never blocked for longer; run it again later: {exc}"
        ) from exc
    except psycopg.Error as exc:
        raise MigrationError(f"{migration.path.name}: {exc}") from exc


def _retry_lock_timeouts(action: Callable[[], None], attempts: int, migration: Migration) -> None:
    for attempt in range(1, attempts + 1):
        try:
            action()
            return
        except psycopg.errors.LockNotAvailable:
            if attempt >= attempts:
                raise
            log.warning("migration_lock_timeout", migration=migration.path.name, attempt=attempt)
            time.sleep(LOCK_RETRY_DELAY * 2 ** (attempt - 1))


def _execute(conn: psycopg.Connection[Row], statement: LiteralString) -> None:
    """One statement outside a transaction; no invalid index survives a concurrent build."""
    index = _CONCURRENT_INDEX.match(statement)
    if index is None:
        conn.execute(statement)
        return
    name, table = index.group(1), index.group(2)
    _drop_invalid_index(conn, table, name)
    try:
        conn.execute(statement)
    except psycopg.Error:
        try:
            _drop_invalid_index(conn, table, name)
        except psycopg.Error as cleanup:
            log.error("invalid_index_left", index=name, error=str(cleanup))
        raise


def _drop_invalid_index(conn: psycopg.Connection[Row], table: str, name: str) -> None:
    row = fetch_one(conn, "invalid_index", {"table": table, "index": name})
    if row is None:
        return
    conn.execute(
        sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(
            sql.Identifier(row["schema_name"], row["index_name"])
        )
    )
    log.warning("invalid_index_dropped", index=name, table=table)


def _split_statements(text: str) -> list[LiteralString]:
    """Split a no-transaction migration on `;` at line ends, outside `$$` quoted bodies."""
    statements: list[str] = []
    current: list[str] = []
    quote: str | None = None
    for line in text.splitlines():
        if quote is None and line.lstrip().startswith("--"):
            continue
        for tag in _DOLLAR_QUOTE.findall(line):
            quote = tag if quote is None else (None if tag == quote else quote)
        current.append(line)
        if quote is None and line.rstrip().endswith(";"):
            statements.append("\n".join(current))
            current = []
    statements.append("\n".join(current))
    return [s.strip() for s in statements if s.strip().rstrip(";").strip()]
