"""A stop signal that lands while the process is writing a log line.

The log's lock is not reentrant, nor is an Event's: a handler that logged, or
set an Event, would wait for the lock its own thread holds, forever. The
dashboard's handler only raises, and logs once out of the server's loop; the
outbox worker's only notes the signal, and its main thread asks the loop to
stop.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
import structlog

from control import dashboard
from outbox_worker import main as outbox_main
from payhook.settings import Settings


class PokingStdout(io.TextIOWrapper):
    """stdout whose binary side sends this process SIGTERM while it writes a line saying `poke`."""

    def __init__(self) -> None:
        self.written = PokingBuffer()
        super().__init__(self.written)

    def isatty(self) -> bool:
        return False


class PokingBuffer(io.BytesIO):
    def write(self, data: Any) -> int:
        if b'"poke"' in bytes(data):
            os.kill(os.getpid(), signal.SIGTERM)
        return super().write(data)


@contextmanager
def alarm_after(seconds: int) -> Iterator[None]:
    """Fail, rather than hang, if the block waits for a lock it holds."""

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError("the stop signal's handler waited for a lock its thread holds")

    saved = {s: signal.getsignal(s) for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        for s, handler in saved.items():
            signal.signal(s, handler)


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # the dashboard configured logging to the test's stdout


class FakeServer:
    server_port = 9181

    def serve_forever(self, poll_interval: float) -> None:
        dashboard.log.info("poke")
        raise AssertionError("the signal did not stop the server")

    def server_close(self) -> None:
        pass


def test_the_dashboard_stops_on_a_signal_that_lands_mid_log_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stdout = PokingStdout()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(dashboard, "make_server", lambda *args, **kwargs: FakeServer())
    monkeypatch.setenv("PAYHOOK_DASHBOARD_PASSWORD", "pw")
    settings = Settings.from_env(
        {"DATABASE_URL": "postgresql://127.0.0.1/x", "REDIS_URL": "redis://127.0.0.1:6379/15",
         "PAYHOOK_DASHBOARD_PASSWORD": "pw"}
    )  # fmt: skip
    with alarm_after(5):
        assert dashboard.run(settings, host="127.0.0.1", port=9181) == 0
    lines = stdout.written.getvalue().decode()
    assert '"dashboard_stopping"' in lines and '"signal":"SIGTERM"' in lines
    assert '"dashboard_stopped"' in lines


class SignalledTwiceWorker:
    """An outbox loop that is sent SIGTERM, and again while `stop()` holds a
    lock, as `threading.Event.set` holds its own: a second signal (Ctrl-C
    twice, `payhook up` dying as it stops its children) lands there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.closed = False

    def run(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        self.stopped.wait(10)

    def stop(self) -> None:
        with self.lock:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs here, on this thread
        self.stopped.set()

    def close(self) -> None:
        self.closed = True


def test_the_outbox_worker_stops_on_a_signal_that_lands_while_it_is_stopping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(outbox_main, "Worker", SignalledTwiceWorker)
    settings = Settings.from_env(
        {"DATABASE_URL": "postgresql://127.0.0.1:1/x", "REDIS_URL": "redis://127.0.0.1:6379/15"}
    )
    with alarm_after(5):
        assert outbox_main.run(settings) == 0
