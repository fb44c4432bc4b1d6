"""Forward-only migrations from `sql/migrations/NNNN_name.sql`.

`apply_migrations` takes a session advisory lock, so any number of processes
may run it at once: one applies, the others wait and then find nothing to do.
Each file runs in its own transaction and is recorded in
`payhook.schema_migrations` in that same transaction. A file whose first line
is `-- payhook: no-transaction` runs statement by statement outside a
transaction, for `CREATE INDEX CONCURRENTLY`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import LiteralString, cast

import psycopg
import structlog
from psycopg import sql

from payhook.db import connect
from payhook.errors import MigrationError
from payhook.queries import query, sql_root
from payhook.settings import Settings

log = structlog.get_logger(__name__)

#: Key of the advisory lock that serializes migration runs (any fixed bigint).
MIGRATION_LOCK_KEY = 0x7061796886F6F6B
#: How long DDL may wait for a lock before failing instead of stalling consumers.
LOCK_TIMEOUT = "5s"
#: How long one migration statement may run.
STATEMENT_TIMEOUT = "15min"
#: Seconds between polls of the migration lock, doubling up to the maximum.
LOCK_POLL_MIN = 0.05
LOCK_POLL_MAX = 1.0
NO_TRANSACTION_MARKER = "-- payhook: no-transaction"

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


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


def applied_versions(conn: psycopg.Connection[dict[str, object]]) -> set[int]:
    rows = conn.execute(query("applied_migrations")).fetchall()
    return {int(cast(int, row["version"])) for row in rows}


def apply_migrations(settings: Settings, folder: Path | None = None) -> list[str]:
    """Apply every pending migration; the names of those applied by this call."""
    migrations = list_migrations(folder)
    ensure_database(settings)
    applied: list[str] = []
    timeouts = f"-c lock_timeout={LOCK_TIMEOUT} -c statement_timeout={STATEMENT_TIMEOUT}"
    with connect(settings, "migrate", options=timeouts) as conn:
        _lock(conn)
        try:
            conn.execute(query("create_migrations_table"))
            done = applied_versions(conn)
            for migration in migrations:
                if migration.version in done:
                    continue
                _apply_one(conn, migration)
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


def _apply_one(conn: psycopg.Connection[dict[str, object]], migration: Migration) -> None:
    text: LiteralString = migration.path.read_text()
    record = query("record_migration")
    params = {"version": migration.version, "name": migration.name}
    try:
        if migration.transactional:
            with conn.transaction():
                conn.execute(text)
                conn.execute(record, params)
        else:
            for statement in _split_statements(text):
                conn.execute(statement)
            conn.execute(record, params)
    except psycopg.Error as exc:
        raise MigrationError(f"{migration.path.name}: {exc}") from exc


def _split_statements(text: str) -> list[LiteralString]:
    """Split a no-transaction migration on `;` at line ends (no dollar quoting there)."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in body.split(";\n") if s.strip().rstrip(";")]
