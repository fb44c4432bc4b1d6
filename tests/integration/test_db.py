"""`pipelined_transaction`: two round trips, and never a transaction left open."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import pq

from payhook.db import Row, pipelined_transaction

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
