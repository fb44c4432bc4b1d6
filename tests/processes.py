"""Real payhook processes for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from payhook.settings import Settings


def process_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a payhook process with `settings`: none of ours inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYHOOK_")}
    env |= {
        "DATABASE_URL": str(settings.database_url),
        "REDIS_URL": str(settings.redis_url),
        "PAYHOOK_QUEUE": settings.queue,
        "PAYHOOK_DATABASE_ROLE": settings.database_role,
        "PAYHOOK_LOG_LEVEL": "INFO",
    }
    # The key-encryption keys the settings name (a process opens the secrets with them).
    for name in ("PAYHOOK_SECRETS_KEY", "PAYHOOK_SECRETS_KEY_FILE"):
        value = settings.get(name)
        if value:
            env[name] = str(value)
    return env | extra


def run_cli(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`payhook ARGS` run to completion with `settings` (and `env` on top); its output."""
    return subprocess.run(
        [sys.executable, "-m", "control.cli", *args],
        env=process_env(settings, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def start(args: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`payhook ARGS` in its own process group, output to `log`."""
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "control.cli", *args],
            env=dict(env),
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> int:
    """Signal the process group and wait; SIGKILL what is left."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # orphaned children (RQ's scheduler)
        except ProcessLookupError:
            pass


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
