"""`pipelined_transaction`: two round trips, and never a transaction left open;
`pooled_connection`: never a connection the server has ended."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import pq

from ingress.endpoints import PostgresEndpoints
from payhook.db import (
    Row,
    connect,
    create_pool,
    ended_by_server,
    pipelined_transaction,
    pooled_connection,
)
from payhook.settings import Settings
from tests.factories import Factory
from tests.locks import released_after

SCRATCH = "CREATE TEMPORARY TABLE scratch (n int NOT NULL)"


@contextmanager
def protocol_trace(conn: psycopg.Connection[Row]) -> Iterator[list[str]]:
    """The frontend/backend messages exchanged inside the block, one per line (libpq's trace)."""
    lines: list[str] = []
    with tempfile.TemporaryFile() as file:
        conn.pgconn.trace(file.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield lines
        finally:
            conn.pgconn.untrace()
            file.seek(0)
            lines.extend(file.read().decode().splitlines())


def count(conn: psycopg.Connection[Row]) -> int:
    row = conn.execute("SELECT count(*) AS n FROM scratch").fetchone()
    assert row is not None
    return int(row["n"])


def test_a_transaction_that_reads_once_syncs_once(conn: psycopg.Connection[Row]) -> None:
    """BEGIN and the first statements go out together, then the writes with
    COMMIT and the one Sync: a second Sync would be a third round trip."""
    conn.execute(SCRATCH)
    with protocol_trace(conn) as trace, pipelined_transaction(conn):
        conn.execute("INSERT INTO scratch VALUES (1)")
        assert conn.execute("SELECT count(*) AS n FROM scratch").fetchone() == {"n": 1}
        conn.execute("INSERT INTO scratch VALUES (2)")
    sent = [line.split("\t")[2] for line in trace if line.startswith("F\t")]
    assert sent.count("Sync") == 1, trace
    assert 'CommandComplete\t "COMMIT"' in "\n".join(trace)
    assert count(conn) == 2
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE


def test_a_statement_failing_with_the_final_sync_rolls_everything_back(
    conn: psycopg.Connection[Row],
) -> None:
    """An error whose result arrives with COMMIT's Sync (nothing fetched it
    before) is raised, and the statements before it do not commit."""
    conn.execute(SCRATCH)
    with pytest.raises(psycopg.errors.NotNullViolation), pipelined_transaction(conn):
        conn.execute("INSERT INTO scratch VALUES (1)")
        conn.execute("INSERT INTO scratch VALUES (NULL)")
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert count(conn) == 0


def test_an_error_raised_in_the_block_rolls_back(conn: psycopg.Connection[Row]) -> None:
    conn.execute(SCRATCH)
    with pytest.raises(LookupError), pipelined_transaction(conn):
        conn.execute("INSERT INTO scratch VALUES (1)")
        assert conn.execute("SELECT count(*) AS n FROM scratch").fetchone() == {"n": 1}
        raise LookupError("the caller changed its mind")
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert count(conn) == 0


def test_a_failed_read_rolls_back_and_leaves_the_connection_usable(
    conn: psycopg.Connection[Row],
) -> None:
    conn.execute(SCRATCH)
    with pytest.raises(psycopg.errors.DivisionByZero), pipelined_transaction(conn):
        conn.execute("INSERT INTO scratch VALUES (1)")
        conn.execute("SELECT 1 / 0").fetchone()
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    with pipelined_transaction(conn):
        conn.execute("INSERT INTO scratch VALUES (2)")
    assert count(conn) == 1


def test_interrupted_while_the_final_sync_waits_on_a_lock_cancels_and_commits_nothing(
    conn: psycopg.Connection[Row], settings: Settings
) -> None:
    """A job timeout that fires while COMMIT's batch waits on another
    transaction's row lock must end the wait then, not when the lock is
    released, and leave nothing committed."""
    from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty

    conn.execute("CREATE TABLE locked (n int PRIMARY KEY, seen int)")
    conn.execute("CREATE TABLE written (n int)")
    conn.execute("INSERT INTO locked VALUES (1, 0)")
    with connect(settings, "holder", autocommit=False) as holder:
        holder.execute("SELECT 1 FROM locked WHERE n = 1 FOR UPDATE")
        with released_after(holder) as released_by_watchdog:
            with (
                pytest.raises(JobTimeoutException),
                UnixSignalDeathPenalty(1, JobTimeoutException),
                pipelined_transaction(conn),
            ):
                conn.execute("INSERT INTO written VALUES (1)")
                # Nothing fetches this result: it waits inside the final Sync.
                conn.execute("UPDATE locked SET seen = seen + 1 WHERE n = 1")
        assert not released_by_watchdog.is_set(), "the transaction waited for the lock holder"
        holder.rollback()
    assert conn.closed, "a connection left mid-pipeline is closed, not reused"
    with connect(settings, "check") as check:
        assert check.execute("SELECT count(*) AS n FROM written").fetchone() == {"n": 0}
        # The lock is free at once: the cancelled statement holds nothing.
        check.execute("SET lock_timeout = '5s'")
        assert check.execute("UPDATE locked SET seen = seen WHERE n = 1").rowcount == 1
        assert check.execute("SELECT seen FROM locked").fetchone() == {"seen": 0}


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

    with connect(settings) as one:
        assert used(one) == wanted
    pool = create_pool(settings, "test", size=1)
    pool.open(wait=True)
    try:
        with pool.connection() as pooled:
            assert used(pooled) == wanted
    finally:
        pool.close()

    async def reader() -> dict[str, str]:
        endpoints = PostgresEndpoints(settings.database_url)
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
    with connect(own) as tuned:
        assert used(tuned) == wanted | {"keepalives_idle": "5", "tcp_user_timeout": "0"}


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
    with connect(settings) as other:
        other.execute("NOTIFY payhook_test")
    with protocol_trace(conn) as trace:
        assert not ended_by_server(conn)
    assert any("Query" in line for line in trace), trace
    assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}


def test_a_connection_the_server_ended_is_known_ended(factory: Factory, settings: Settings) -> None:
    with connect(settings) as victim:
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
