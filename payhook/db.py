"""PostgreSQL access: the connection pool and named-query helpers."""

from __future__ import annotations

import select
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
import structlog
from psycopg import pq
from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import Loader
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg.types.datetime import TimestamptzLoader
from psycopg_pool import ConnectionPool

from payhook.errors import DatabaseRoleError, PoolerError
from payhook.queries import query
from payhook.settings import DEFAULT_DATABASE_ROLE, Settings

log = structlog.get_logger(__name__)

#: Seconds a new connection may take before the pool gives up on it.
CONNECT_TIMEOUT = 5
#: Application name every payhook connection carries, visible in pg_stat_activity.
APPLICATION_NAME = "payhook"

Row = dict[str, Any]
Pool = ConnectionPool[psycopg.Connection[Row]]


#: TCP settings of every connection a payhook process holds, unless its URL
#: sets them. A server lost without a word (a network partition, a host gone:
#: no RST) would leave a read waiting for the kernel's own keepalive, two hours
#: by default; these find it in about a minute. Probes are answered by the
#: server's kernel, so a long statement is never cut by them.
KEEPALIVES: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    # Data sent and not acknowledged for this long: the server is gone.
    "tcp_user_timeout": 60_000,
}


#: Server settings of every payhook connection. Its SQL is written for READ
#: COMMITTED, whatever a database's or role's default: the consumer's
#: function reads the archive in a statement after its insert, which sees
#: what that insert waited for only on a snapshot of its own.
SESSION_SETTINGS = {"default_transaction_isolation": "read committed"}


def connection_kwargs(
    component: str,
    url: str,
    settings: Mapping[str, str] | None = None,
    *,
    role: str | None = None,
    pooled: bool = False,
) -> dict[str, Any]:
    """Options for every connection a payhook process holds to `url`, with
    `SESSION_SETTINGS` and `settings` after any `options` the URL gives.

    With `role`, the connection works as that role from its start (the
    server's `role` setting, as `SET ROLE` would): `payhook_app`, under
    row-level security, for everything but the owner's commands.

    `pooled`: `url` reaches PostgreSQL through a pooler in transaction mode,
    which hands each transaction to any of its server sessions. Nothing
    session-wide is sent (a pooler refuses startup options, and a `SET`
    would stay on a session other clients get next): the session settings
    are the login role's (`ALTER ROLE ... SET`, docs/scaling.md), and
    statements are never prepared on the server, where the next
    transaction may not find them.
    """
    given = conninfo_to_dict(url)
    common = {
        "autocommit": True,
        "row_factory": dict_row,
        "application_name": f"{APPLICATION_NAME}-{component}",
        "connect_timeout": CONNECT_TIMEOUT,
    } | {name: value for name, value in KEEPALIVES.items() if name not in given}
    if pooled:
        return common | {"prepare_threshold": None}
    options = [str(given["options"])] if given.get("options") else []
    extra = {"role": role} if role else {}
    for name, value in (SESSION_SETTINGS | extra | dict(settings or {})).items():
        escaped = value.replace("\\", "\\\\").replace(" ", "\\ ")
        options.append(f"-c {name}={escaped}")
    return common | {"options": " ".join(options)}


def create_pool(
    settings: Settings,
    component: str,
    *,
    size: int | None = None,
    statement_timeout: float | None = None,
) -> Pool:
    """A closed pool; the process opens it when it starts (`pool.open()`).

    With `statement_timeout` (seconds), no statement, lock wait included, and
    no idle transaction may last longer: the server ends it.
    """
    size = size or settings.db_pool_size
    timeouts = {}
    if statement_timeout is not None:
        ms = str(max(1, int(statement_timeout * 1000)))
        timeouts = {"statement_timeout": ms, "idle_in_transaction_session_timeout": ms}
    pooled = settings.database_pooler == "transaction"
    if pooled and timeouts:
        log.info("session_settings_from_role", component=component, unsent=sorted(timeouts))
    kwargs = connection_kwargs(
        component, settings.database_url, timeouts, role=settings.database_role, pooled=pooled
    )
    return ConnectionPool(
        settings.database_url,
        connection_class=psycopg.Connection[Row],
        min_size=1,
        max_size=size,
        kwargs=kwargs,
        open=False,
        name=component,
        timeout=10,
        reconnect_timeout=60,
    )


def connect(
    settings: Settings,
    component: str = "cli",
    *,
    owner: bool = False,
    direct: bool = False,
    **overrides: Any,
) -> psycopg.Connection[Row]:
    """One connection, for commands and tests, as `settings.database_role`
    (under row-level security) unless `owner`: as the role the URL logs in
    as, for the commands that change the schema or every tenant's secrets.

    `owner`, `direct` and session `options` connect through
    `PAYHOOK_DATABASE_DIRECT_URL` when it is set: a session of their own,
    past any pooler (a lock held across transactions, LISTEN, settings).
    Behind a transaction pooler without it, `direct` and `options` are
    refused (`PoolerError`).
    """
    url, pooled = settings.database_url, settings.database_pooler == "transaction"
    role = None if owner else settings.database_role
    # Session options, like a lock across transactions, need a session of its own.
    session = direct or "options" in overrides
    if (owner or session) and settings.database_direct_url:
        url, pooled = settings.database_direct_url, False
        if not owner and settings.database_pooler == "transaction":
            # The direct URL may log in as the owner: work under row-level
            # security all the same, as the pooled connections do.
            role = DEFAULT_DATABASE_ROLE
    elif session and pooled:
        raise PoolerError(
            f"{component} needs a session of its own, which a transaction pooler does not "
            "give: set PAYHOOK_DATABASE_DIRECT_URL to reach PostgreSQL itself"
        )
    kwargs = connection_kwargs(component, url, role=role, pooled=pooled)
    if "options" in overrides:
        # After the role and session settings, never instead of them.
        kwargs["options"] = f"{kwargs['options']} {overrides.pop('options')}"
    try:
        return psycopg.connect(url, **(kwargs | overrides))
    except psycopg.OperationalError as exc:
        if role and role_refused(exc, role):
            raise DatabaseRoleError(role) from exc
        raise


def role_refused(exc: psycopg.OperationalError, role: str) -> bool:
    """Whether the server refused a connection for its `role` setting: the
    role does not exist, or the login may not take it."""
    text = str(exc)
    return f'role "{role}" does not exist' in text or f'set role "{role}"' in text


@contextmanager
def tenant_transaction(
    conn: psycopg.Connection[Row], tenant_id: str | UUID | None
) -> Iterator[None]:
    """A transaction that sees and writes only `tenant_id`'s rows: the
    tenant row-level security reads (`payhook.current_tenant()`) is set
    until it ends. None: no tenant's rows (a security anomaly that names no
    tenant may still be written). Nested in another transaction, a
    savepoint of it."""
    with conn.transaction():
        conn.execute(query("set_tenant"), {"tenant_id": tenant_id})
        yield


@contextmanager
def pooled_connection(pool: Pool) -> Iterator[psycopg.Connection[Row]]:
    """`pool.connection()`, never handing out a connection the server has ended.

    After a restart, a failover or `pg_terminate_backend`, the pool still
    holds connections the server closed, and a job would fail on its first
    statement: one retry spent, or, on its last, a dead-lettered job whose
    event was never applied. A connection that is ended goes back to the
    pool, which drops it and connects anew; the next idle one is tried, and
    once every one the pool may hold has been, a new one is used as it comes.
    """
    for _ in range(pool.max_size):
        conn = pool.getconn()
        try:
            ended = ended_by_server(conn)
        except BaseException:
            pool.putconn(conn)
            raise
        if not ended:
            break
        pool.putconn(conn)
    else:
        conn = pool.getconn()
    try:
        with conn:
            yield conn
    finally:
        pool.putconn(conn)


def ended_by_server(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection is known to be gone, at the cost of one `poll`.

    An idle connection has nothing to read unless the server ended it (an
    error saying why, then the end of the stream) or sent something unasked,
    a notice or a notification; only then does an empty query, one round
    trip, tell which. A server lost without a word (no FIN: a host gone, a
    partition) is not seen here but by the first statement, within the TCP
    timeouts of `KEEPALIVES`.
    """
    if conn.closed:
        return True
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    if not poller.poll(0):
        return False
    try:
        conn.execute("")
    except psycopg.OperationalError:
        return True
    return conn.closed


#: The connection each thread waits on in `cancelled_if_interrupted`, by thread id.
_waiting: dict[int, psycopg.Connection[Any]] = {}


@contextmanager
def cancelled_if_interrupted(conn: psycopg.Connection[Row]) -> Iterator[None]:
    """Cancel the statement running on `conn` if the block is interrupted
    from outside (a job's timeout, a signal) while waiting for it, e.g. on a
    lock; the connection is then closed (the pool drops it) and the
    interruption raised. Otherwise the statement would run on, holding its
    locks, on a connection stuck mid-statement. A statement that committed
    before the cancel arrived stays committed: a retried job finds its receipt.

    Signals interrupt only the main thread: one that waits for this block
    on another thread cancels the statement with `cancel_waiting`.
    """
    thread = threading.get_ident()
    _waiting[thread] = conn
    try:
        yield
    except BaseException as exc:
        if (
            not isinstance(exc, psycopg.Error)
            and not conn.closed
            and conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE
        ):
            with suppress(psycopg.Error):
                conn.cancel_safe(timeout=5)
            conn.close()
        raise
    finally:
        del _waiting[thread]


def cancel_waiting(thread: int) -> None:
    """Cancel the statement thread `thread` waits for in `cancelled_if_interrupted`,
    if any: the thread sees the error and the statement's transaction rolls back."""
    conn = _waiting.get(thread)
    if conn is not None:
        with suppress(psycopg.Error):
            conn.cancel_safe(timeout=5)


def fetch_one(
    conn: psycopg.Connection[Row] | psycopg.Cursor[Row],
    name: str,
    params: Mapping[str, Any] | None = None,
) -> Row | None:
    """Run a named query; its first row or None."""
    return conn.execute(query(name), params or {}).fetchone()


def fetch_all(
    conn: psycopg.Connection[Row] | psycopg.Cursor[Row],
    name: str,
    params: Mapping[str, Any] | None = None,
) -> list[Row]:
    """Run a named query; all its rows."""
    return conn.execute(query(name), params or {}).fetchall()


def execute(
    conn: psycopg.Connection[Row], name: str, params: Mapping[str, Any] | None = None
) -> int:
    """Run a named query; the number of rows it touched."""
    return conn.execute(query(name), params or {}).rowcount


def tenant_of(conn: psycopg.Connection[Row], table: str, row_id: object) -> str | None:
    """The tenant of the row of `table` (`payment_exceptions`, `payment_outbox`,
    `webhook_endpoints`) whose id is `row_id`, None when there is none: the
    one lookup across tenants an operator's command makes before it works
    under that tenant (`tenant_transaction`)."""
    row = fetch_one(conn, "tenant_of", {"table": table, "id": str(row_id)})
    return None if row is None or row["tenant_id"] is None else str(row["tenant_id"])


class _TimestamptzOrText(Loader):
    """psycopg's own loader, but a time Python cannot hold is its text."""

    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        self._datetime = TimestamptzLoader(oid, context)

    def load(self, data: Buffer) -> datetime | str:
        try:
            return self._datetime.load(data)
        except psycopg.DataError:
            return bytes(data).decode()


def tolerant_cursor(conn: psycopg.Connection[Row]) -> psycopg.Cursor[Row]:
    """A cursor of `conn` that reads a `timestamptz` Python's datetime cannot
    hold (past year 9999 or before year 1 in the session's time zone,
    infinity) as the text PostgreSQL writes, where psycopg would fail the
    row: for commands that show whatever was stored."""
    cursor = conn.cursor()
    cursor.adapters.register_loader("timestamptz", _TimestamptzOrText)
    return cursor


def error_summary(exc: BaseException) -> str:
    """What may be logged or kept of an error: its class, and the SQLSTATE of
    PostgreSQL's, whose text may quote the data it could not read."""
    sqlstate = getattr(exc, "sqlstate", None)
    name = exc.__class__.__name__
    return f"{name}, SQLSTATE {sqlstate}" if sqlstate else name
