"""PostgreSQL access: the connection pool and named-query helpers."""

from __future__ import annotations

import select
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from payhook.queries import query
from payhook.settings import Settings

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


def connection_kwargs(component: str, url: str) -> dict[str, Any]:
    """Options for every connection a payhook process holds to `url`."""
    given = conninfo_to_dict(url)
    return {
        "autocommit": True,
        "row_factory": dict_row,
        "application_name": f"{APPLICATION_NAME}-{component}",
        "connect_timeout": CONNECT_TIMEOUT,
    } | {name: value for name, value in KEEPALIVES.items() if name not in given}


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
    kwargs = connection_kwargs(component, settings.database_url)
    if statement_timeout is not None:
        ms = max(1, int(statement_timeout * 1000))
        kwargs["options"] = f"-c statement_timeout={ms} -c idle_in_transaction_session_timeout={ms}"
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
    settings: Settings, component: str = "cli", **overrides: Any
) -> psycopg.Connection[Row]:
    """One connection, for commands and tests."""
    kwargs = connection_kwargs(component, settings.database_url) | overrides
    return psycopg.connect(settings.database_url, **kwargs)


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


@contextmanager
def pipelined_transaction(conn: psycopg.Connection[Row]) -> Iterator[psycopg.Pipeline]:
    """A transaction whose statements travel in pipeline mode.

    BEGIN goes out with the first statements and COMMIT with the Sync that
    ends the pipeline, so a transaction that reads once costs two round trips.
    (`conn.transaction()` inside a pipeline adds a sync of its own, and so
    would a `pipeline.sync()` before leaving it.) On any error, raised in the
    block or by a statement whose result arrives with the final Sync, the
    transaction is rolled back and the error re-raised; a broken connection
    is left to the pool, which discards it. `conn` must be in autocommit mode.
    """
    try:
        with conn.pipeline() as pipeline:
            conn.execute(query("begin"))
            try:
                yield pipeline
            except BaseException as exc:
                if not isinstance(exc, psycopg.Error):
                    # Interrupted from outside (a job timeout, Ctrl-C) while a
                    # statement may still run, e.g. waiting on a lock: cancel
                    # it, or leaving the pipeline would wait for it.
                    with suppress(psycopg.Error):
                        conn.cancel_safe(timeout=5)
                raise
            conn.execute(query("commit"))
    except BaseException as exc:
        if conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
            # Interrupted while the final Sync waited, e.g. on a lock: the
            # statement still runs, holding its locks, and the connection is
            # stuck mid-pipeline. Cancel the statement and close the
            # connection; the server rolls the transaction back (unless
            # COMMIT ran before the cancel arrived: a retry is a duplicate).
            with suppress(psycopg.Error):
                conn.cancel_safe(timeout=5)
            conn.close()
            # psycopg reports the interrupted exit as an error of its own
            # ("cannot exit pipeline mode while busy"): raise the interruption.
            interruption = exc.__context__
            if isinstance(exc, psycopg.Error) and interruption is not None:
                if not isinstance(interruption, psycopg.Error):
                    raise interruption from None
        else:
            # A statement failed, or the block did: end the transaction, open
            # or aborted. (A COMMIT whose reply was lost may have committed;
            # a retried job then finds its receipt.)
            with suppress(psycopg.Error):
                conn.execute(query("rollback"))
        raise


def fetch_one(
    conn: psycopg.Connection[Row], name: str, params: Mapping[str, Any] | None = None
) -> Row | None:
    """Run a named query; its first row or None."""
    return conn.execute(query(name), params or {}).fetchone()


def fetch_all(
    conn: psycopg.Connection[Row], name: str, params: Mapping[str, Any] | None = None
) -> list[Row]:
    """Run a named query; all its rows."""
    return conn.execute(query(name), params or {}).fetchall()


def execute(
    conn: psycopg.Connection[Row], name: str, params: Mapping[str, Any] | None = None
) -> int:
    """Run a named query; the number of rows it touched."""
    return conn.execute(query(name), params or {}).rowcount
