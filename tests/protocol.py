"""What a connection says to the server, read from libpq's own trace."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import pq

from payhook.db import Row


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


def sent(trace: list[str]) -> list[str]:
    """The kinds of the messages the client sent (Parse, Bind, Sync, ...)."""
    return [line.split("\t")[2] for line in trace if line.startswith("F\t")]
