"""`cancelled_if_interrupted`: never a statement left running;
`pooled_connection`: never a connection the server has ended."""

from __future__ import annotations

import asyncio
import dataclasses
import select
from typing import Any

import psycopg
import pytest
from psycopg import pq, sql
from psycopg.rows import dict_row

from ingress.endpoints import PostgresEndpoints
from payhook.db import (
    Row,
    cancelled_if_interrupted,
    connect,
    create_pool,
    ended_by_server,
    pooled_connection,
)
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, Factory
from tests.locks import released_after
from tests.protocol import protocol_trace


def test_a_statement_interrupted_while_waiting_on_a_lock_is_cancelled_and_commits_nothing(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    """A job timeout that fires while an autocommit statement waits on another
    transaction's row lock must end the wait then, not when the lock is
    released, and leave nothing committed."""
    from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty

    conn.execute("CREATE TABLE locked (n int PRIMARY KEY, seen int)")
    conn.execute("CREATE TABLE written (n int)")
    conn.execute("INSERT INTO locked VALUES (1, 0)")
    with connect(settings, "holder", autocommit=False, owner=True) as holder:
        holder.execute("SELECT 1 FROM locked WHERE n = 1 FOR UPDATE")
        with released_after(holder) as released_by_watchdog:
            with (
                pytest.raises(JobTimeoutException),
                UnixSignalDeathPenalty(1, JobTimeoutException),
                cancelled_if_interrupted(conn),
            ):
                conn.execute(
                    "WITH w AS (INSERT INTO written VALUES (1))"
                    " UPDATE locked SET seen = seen + 1 WHERE n = 1"
                )
        assert not released_by_watchdog.is_set(), "the statement waited for the lock holder"
        holder.rollback()
    assert conn.closed, "a connection left mid-statement is closed, not reused"
    with connect(settings, "check", owner=True) as check:
        assert check.execute("SELECT count(*) AS n FROM written").fetchone() == {"n": 0}
        # The lock is free at once: the cancelled statement holds nothing.
        check.execute("SET lock_timeout = '5s'")
        assert check.execute("UPDATE locked SET seen = seen WHERE n = 1").rowcount == 1
        assert check.execute("SELECT seen FROM locked").fetchone() == {"seen": 0}


def test_a_failed_statement_leaves_the_connection_open_and_usable(
    conn: psycopg.Connection[Row],
) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero), cancelled_if_interrupted(conn):
        conn.execute("SELECT 1 / 0").fetchone()
    assert not conn.closed
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}


def test_every_connection_finds_a_silently_lost_server_within_about_a_minute(
    settings: Settings,
) -> None:
    """TCP keepalives and a user timeout, not the kernel's two hours: on pooled
    connections, one-off ones and the ingress's endpoint reader alike; what
    the URL sets itself is kept."""
    wanted = {
        "keepalives_idle": "30",
        "keepalives_interval": "10",
        "keepalives_count": "3",
        "tcp_user_timeout": "60000",
    }

    def used(conn: psycopg.Connection[Row] | psycopg.AsyncConnection[Any]) -> dict[str, str]:
        found = conn.info.get_parameters()
        return {k: found.get(k, "") for k in wanted}

    with connect(settings, owner=True) as one:
        assert used(one) == wanted
    pool = create_pool(settings, "test", size=1)
    pool.open(wait=True)
    try:
        with pool.connection() as pooled:
            assert used(pooled) == wanted
    finally:
        pool.close()

    async def reader() -> dict[str, str]:
        endpoints = PostgresEndpoints(settings.database_url, TEST_KEYRING)
        try:
            await endpoints()
            assert endpoints._conn is not None
            return used(endpoints._conn)
        finally:
            await endpoints.close()

    assert asyncio.run(reader()) == wanted

    own = dataclasses.replace(
        settings, database_url=f"{settings.database_url}?keepalives_idle=5&tcp_user_timeout=0"
    )
    with connect(own, owner=True) as tuned:
        assert used(tuned) == wanted | {"keepalives_idle": "5", "tcp_user_timeout": "0"}


def test_every_connection_reads_committed_whatever_the_database_default(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    """payhook's SQL is written for READ COMMITTED; a database (or role) whose
    default is another level does not change it. Options the URL gives are kept."""
    conn.execute(
        sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = 'serializable'").format(
            sql.Identifier(conn.info.dbname)
        )
    )
    with psycopg.connect(settings.database_url, row_factory=dict_row) as plain:
        assert shown(plain, "transaction_isolation") == "serializable", "the test's premise"
    own = dataclasses.replace(
        settings, database_url=f"{settings.database_url}?options=-c%20work_mem%3D5MB"
    )
    with connect(own, owner=True) as direct:
        assert shown(direct, "transaction_isolation") == "read committed"
        assert shown(direct, "work_mem") == "5MB"
    pool = create_pool(own, "test", size=1, statement_timeout=1.5)
    pool.open(wait=True)
    try:
        with pool.connection() as pooled:
            assert shown(pooled, "transaction_isolation") == "read committed"
            assert shown(pooled, "work_mem") == "5MB"
            assert shown(pooled, "statement_timeout") == "1500ms"
    finally:
        pool.close()


def shown(conn: psycopg.Connection[Row], name: str) -> str:
    row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
    assert row is not None
    return str(row[name])


def test_an_idle_connection_is_checked_without_a_round_trip(
    conn: psycopg.Connection[Row],
) -> None:
    with protocol_trace(conn) as trace:
        assert not ended_by_server(conn)
    assert trace == []


def test_a_connection_with_something_unasked_to_read_is_kept_if_alive(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    """A notification makes an idle connection readable too: a round trip
    tells it from a server's goodbye."""
    conn.execute("LISTEN payhook_test")
    with connect(settings, owner=True) as other:
        other.execute("NOTIFY payhook_test")
    # The listener's backend sends the notification on its own time.
    arrived = select.poll()
    arrived.register(conn.fileno(), select.POLLIN)
    assert arrived.poll(10_000), "the notification never reached the client"
    with protocol_trace(conn) as trace:
        assert not ended_by_server(conn)
    assert any("Query" in line for line in trace), trace
    assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}


def test_a_connection_the_server_ended_is_known_ended(factory: Factory, settings: Settings) -> None:
    with connect(settings, owner=True) as victim:
        factory.end_backends([victim.info.backend_pid])
        assert ended_by_server(victim)
        assert victim.closed


def test_the_pool_hands_out_a_new_connection_for_every_ended_one(
    factory: Factory, settings: Settings
) -> None:
    pool = create_pool(settings, "test", size=3)
    pool.open(wait=True)
    try:
        held = [pool.getconn() for _ in range(3)]
        pids = [c.info.backend_pid for c in held]
        for c in held:
            pool.putconn(c)
        factory.end_backends(pids)
        with pooled_connection(pool) as pooled:
            assert pooled.execute("SELECT 1 AS one").fetchone() == {"one": 1}
            assert pooled.info.backend_pid not in pids
    finally:
        pool.close()
