"""Forward-only migrations from `sql/migrations/NNNN_name.sql`.

`apply_migrations` takes a session advisory lock, so any number of processes
may run it at once: one applies, the others wait and then find nothing to do.
Each file runs in its own transaction and is recorded in
`payhook.schema_migrations` in that same transaction. A file whose first line
is `-- payhook: no-transaction` runs statement by statement outside a
transaction, for `CREATE INDEX CONCURRENTLY`; each of its statements must be
safe to run again (`IF NOT EXISTS`), since a failure leaves it unrecorded.
PostgreSQL's own parser (`control.sqltext`) splits it, and a file it cannot
parse is refused before any of its statements runs.

Live tables stay writable while a migration runs:

- DDL waits at most `LOCK_TIMEOUT` for a lock (consumers queue behind a
  waiting ALTER TABLE), then the statement, or the whole transactional file,
  is tried again a few times with backoff before the run gives up.
- `CREATE`/`DROP INDEX CONCURRENTLY` and `REINDEX ... CONCURRENTLY` run with
  no lock timeout: they take no lock that stops writers, and their waits for
  older transactions and snapshots are part of the build, not a queue that
  consumers stand in. `statement_timeout` still bounds them.
- An index that a `CREATE INDEX CONCURRENTLY` left invalid (it failed, or the
  process died) is dropped before the statement runs again and after it fails.
  Each drop may run for `INVALID_INDEX_DROP_TIMEOUT` (not the statement
  timeout) and is tried again, like a lock timeout, only when it ran out of
  that time or deadlocked; one cancelled by an operator is not. An invalid
  unique index still enforces its rule on every write, so one that cannot be
  dropped stops the run with the statement that drops it (`InvalidIndexLeft`).
  Worst case, after a failed build the index stays in place for
  `LOCK_ATTEMPTS` drops of 2 minutes and the waits between them (1, 2, 4 and
  8 s): about 10 minutes 15 seconds, before the run stops saying so.
- A migration that adds a unique rule to a table that already exists is
  refused while rows of the table break the rule (`control.uniqueness`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import LiteralString, cast

import psycopg
import structlog
from pglast import ast
from psycopg import sql

from control.sqltext import Statement, relation_name, statements
from control.unique_rules import RuleError, rules_in
from control.uniqueness import SESSION_OPTIONS, require_no_conflicts
from payhook.db import Row, connect, fetch_one
from payhook.errors import MigrationError
from payhook.outcomes import check_outcomes
from payhook.queries import query, sql_root
from payhook.settings import Settings

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
#: Seconds one drop of an index a concurrent build left invalid may run: while
#: it waits, an invalid unique index goes on refusing writes that break its rule.
INVALID_INDEX_DROP_TIMEOUT = 120.0
#: Seconds between polls of the migration lock, doubling up to the maximum.
LOCK_POLL_MIN = 0.05
LOCK_POLL_MAX = 1.0
NO_TRANSACTION_MARKER = "-- payhook: no-transaction"

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class InvalidIndexLeft(MigrationError):
    """An index a concurrent build left invalid could not be dropped."""


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
    """Create the database named by the direct URL (`Settings.direct_url`)
    when it is missing; True if created."""
    url = settings.direct_url
    info = psycopg.conninfo.conninfo_to_dict(url)
    dbname = str(info.get("dbname") or "")
    if not dbname:
        return False
    try:
        psycopg.connect(url, connect_timeout=5).close()
        return False
    except psycopg.OperationalError as exc:
        if "does not exist" not in str(exc):
            raise
    admin = psycopg.conninfo.make_conninfo(url, dbname="postgres")
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
    with connect(settings, "migrate", owner=True, options=SESSION_OPTIONS) as conn:
        present = fetch_one(conn, "table_exists", {"table": "payhook.schema_migrations"})
        done = applied_versions(conn) if present and present["present"] else set()
    return [m for m in migrations if m.version not in done]


def apply_migrations(
    settings: Settings,
    folder: Path | None = None,
    *,
    lock_timeout: str = LOCK_TIMEOUT,
    lock_attempts: int = LOCK_ATTEMPTS,
    statement_timeout: str | None = None,
) -> list[str]:
    """Apply every pending migration; the names of those applied by this call.

    `statement_timeout` bounds each statement (`STATEMENT_TIMEOUT` by default),
    a concurrent index build and the drop of an invalid index included.
    """
    migrations = list_migrations(folder)
    ensure_database(settings)
    applied: list[str] = []
    options = (
        f"-c lock_timeout={lock_timeout} "
        f"-c statement_timeout={statement_timeout or STATEMENT_TIMEOUT} " + SESSION_OPTIONS
    )
    with connect(settings, "migrate", owner=True, options=options) as conn:
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


def migrate(settings: Settings) -> list[str]:
    """`payhook migrate`: apply every pending migration, then check that the
    schema lists the outcomes this release records (`OutcomesMismatch`), so
    that a deploy whose code and migrations disagree stops before its
    consumers start."""
    applied = apply_migrations(settings)
    with connect(settings, "migrate", owner=True) as conn:
        check_outcomes(conn)
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
            found = statements(text)
            _require_readable(found, migration)
            for statement in found:
                run = partial(_execute, conn, statement, attempts)
                _retry_lock_timeouts(run, attempts, migration)
            conn.execute(record, params)
    except InvalidIndexLeft as exc:
        raise InvalidIndexLeft(f"{migration.path.name}: {exc}") from exc.__cause__
    except psycopg.errors.LockNotAvailable as exc:
        raise MigrationError(
            f"{migration.path.name}: no lock within lock_timeout in {attempts} tries, "
            f"so consumers were never blocked for longer; run it again later: {exc}"
        ) from exc
    except psycopg.Error as exc:
        raise MigrationError(f"{migration.path.name}: {exc}") from exc


def _require_readable(found: list[Statement], migration: Migration) -> None:
    """Refuse, before any statement runs, one PostgreSQL cannot parse, and a
    concurrent build that does not name its index.

    A failed build leaves an invalid index behind, and only its name finds
    it to drop it; PostgreSQL would give the next attempt another name.
    """
    for statement in found:
        written = " ".join(statement.text.split())
        if statement.node is None:
            raise MigrationError(
                f"{migration.path.name}: PostgreSQL cannot parse ({statement.error}): {written}"
            )
        match statement.node:
            case ast.IndexStmt(concurrent=True, idxname=None):
                raise MigrationError(
                    f"{migration.path.name}: a concurrent index build must name its index "
                    "(CREATE INDEX CONCURRENTLY IF NOT EXISTS name ON ...): an invalid index "
                    f"a failed build leaves is found by name: {written}"
                )


def _concurrent(node: ast.Node | None) -> bool:
    """Whether a statement is one whose waits never queue writers (CREATE, DROP
    or REINDEX ... CONCURRENTLY): it runs without lock_timeout."""
    match node:
        case ast.IndexStmt(concurrent=True) | ast.DropStmt(concurrent=True):
            return True
        case ast.ReindexStmt(params=params):
            return any(p.defname == "concurrently" and _true(p.arg) for p in params or ())
    return False


def _true(arg: ast.Node | None) -> bool:
    """An option's value as PostgreSQL reads a boolean: none given is true."""
    match arg:
        case ast.String(sval=str(word)):
            return word not in ("false", "off")
        case ast.Integer(ival=number):
            return number != 0
    return True


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


def _execute(conn: psycopg.Connection[Row], statement: Statement, attempts: int) -> None:
    """One statement outside a transaction; no invalid index survives a concurrent build."""
    if not _concurrent(statement.node):
        conn.execute(statement.text)
        return
    with _without_lock_timeout(conn):
        index = statement.node
        if not isinstance(index, ast.IndexStmt) or index.relation is None or not index.idxname:
            conn.execute(statement.text)
            return
        name, table = index.idxname, relation_name(index.relation)
        _drop_invalid_index(conn, table, name, attempts)
        try:
            conn.execute(statement.text)
        except psycopg.Error as exc:
            try:
                _drop_invalid_index(conn, table, name, attempts)
            except InvalidIndexLeft as left:
                raise InvalidIndexLeft(f"the build failed ({exc}), and {left}") from exc
            raise


@contextmanager
def _without_lock_timeout(conn: psycopg.Connection[Row]) -> Iterator[None]:
    """The session's lock_timeout off for a concurrent index statement, then back."""
    conn.execute(query("disable_lock_timeout"))
    try:
        yield
    finally:
        if not conn.broken:
            conn.execute(query("restore_lock_timeout"))


#: Errors after which dropping an invalid index is tried again (QueryCanceled
#: only when the drop ran out of its own time: see `_ran_out_of_time`).
#: Errors of a drop worth another try. (It runs with no lock timeout, as
#: every concurrent statement does: a lock wait ends in its statement timeout.)
_DROP_RETRYABLE = (psycopg.errors.QueryCanceled, psycopg.errors.DeadlockDetected)


def _drop_invalid_index(
    conn: psycopg.Connection[Row], table: str, name: str, attempts: int
) -> None:
    """Drop the index if a concurrent build left it invalid, trying `attempts` times."""
    budget = INVALID_INDEX_DROP_TIMEOUT
    for attempt in range(1, attempts + 1):
        row = fetch_one(conn, "invalid_index", {"table": table, "index": name})
        if row is None:
            return
        index = sql.Identifier(row["schema_name"], row["index_name"])
        drop = sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(index)
        started = time.monotonic()
        try:
            with _statement_timeout(conn, budget):
                conn.execute(drop)
        except _DROP_RETRYABLE as exc:
            elapsed = time.monotonic() - started
            if attempt >= attempts or not _ran_out_of_time(exc, elapsed, budget):
                _give_up(conn, table, name, drop, attempt, exc)
                return
            log.warning("invalid_index_drop_retry", index=name, attempt=attempt, error=str(exc))
            time.sleep(LOCK_RETRY_DELAY * 2 ** (attempt - 1))
            continue
        except psycopg.Error as exc:
            _give_up(conn, table, name, drop, attempt, exc)
            return
        log.warning("invalid_index_dropped", index=name, table=table)
        return


def _ran_out_of_time(exc: psycopg.Error, elapsed: float, budget: float) -> bool:
    """Whether a failed drop is worth trying again: a deadlock, or a cancel
    that came once its time was up.

    A statement timeout and an operator's pg_cancel_backend raise the same
    error (57014), told apart only by translated message text: the time the
    drop ran tells them apart instead, so a cancel in the last moments of the
    budget is taken for the timeout.
    """
    if not isinstance(exc, psycopg.errors.QueryCanceled):
        return True
    return elapsed >= budget * 0.9


def _give_up(
    conn: psycopg.Connection[Row],
    table: str,
    name: str,
    drop: sql.Composed,
    tries: int,
    exc: psycopg.Error,
) -> None:
    """Raise InvalidIndexLeft with the index's state as it is now; none if it is gone."""
    if conn.broken:
        raise InvalidIndexLeft(_left_behind(None, drop, tries, exc)) from exc
    row = fetch_one(conn, "invalid_index", {"table": table, "index": name})
    if row is None:
        log.warning("invalid_index_dropped", index=name, table=table)
        return
    raise InvalidIndexLeft(_left_behind(row, drop, tries, exc)) from exc


@contextmanager
def _statement_timeout(conn: psycopg.Connection[Row], seconds: float) -> Iterator[None]:
    """The session's statement_timeout set to `seconds` for a while, then back."""
    conn.execute(query("set_statement_timeout"), {"timeout": f"{round(seconds * 1000)}ms"})
    try:
        yield
    finally:
        if not conn.broken:
            conn.execute(query("restore_statement_timeout"))


def _left_behind(row: Row | None, drop: sql.Composed, tries: int, exc: Exception) -> str:
    """What an invalid index left in place does, and the statement that removes it."""
    statement = drop.as_string()
    if row is None:
        return (
            f"an invalid index may be left in place: the drop failed in {tries} tries and "
            f"the session was lost ({exc}); if it is unique it may still enforce its rule "
            f"on live writes. Check, and drop it from psql: {statement};"
        )
    if row["is_unique"] and row["ready"]:
        effect = (
            "it still enforces its unique rule on live writes: every insert or update "
            "that breaks the rule fails until it is dropped"
        )
    else:
        effect = "it is not used by queries, and writes keep it up to date until it is dropped"
    return (
        f"the invalid index {row['schema_name']}.{row['index_name']} could not be dropped "
        f"in {tries} tries ({exc}); {effect}. Drop it now, from psql: {statement};"
    )
