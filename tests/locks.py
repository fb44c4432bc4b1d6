"""A lock holder that gives up after a while, for tests of code that must not wait for it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg


@contextmanager
def released_after(
    holder: psycopg.Connection[Any], seconds: float = 20
) -> Iterator[threading.Event]:
    """Roll `holder` back after `seconds` unless the block has ended by then.

    Yields an event that is set if it came to that: the code under test
    waited for the lock holder instead of giving up.
    """
    released, done = threading.Event(), threading.Event()

    def watchdog() -> None:
        if not done.wait(seconds):
            released.set()
            holder.rollback()

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        yield released
    finally:
        done.set()
