"""Processes the benchmarks start for themselves: a private Redis, app servers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: Redis persistence a benchmark may ask for; "always" is what compose.yaml,
#: `payhook up` and scripts/services.sh run.
FSYNC_CHOICES = ("always", "everysec", "no")


def spare_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


@contextmanager
def process(args: list[str], env: dict[str, str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_port(port)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def private_redis(fsync: str) -> Iterator[tuple[str, int]]:
    """A redis-server of our own with the given AOF fsync policy ("no": no AOF);
    its URL and pid."""
    port = spare_port()
    folder = tempfile.mkdtemp(prefix="payhook-bench-redis-")
    persistence = ["--appendonly", "no"] if fsync == "no" else ["--appendonly", "yes"]
    persistence += ["--appendfsync", fsync if fsync != "no" else "everysec"]
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--dir", folder, *persistence, "--daemonize", "no", "--logfile", ""]
    try:
        with process(args, dict(os.environ), port) as proc:
            yield f"redis://127.0.0.1:{port}/0", proc.pid
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def cpu_seconds(pid: int, *, reaped_children: bool = False) -> float:
    """User and system CPU seconds a local process has used, with those of its
    children that exited and were reaped if asked; 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # Fields after the command name: state, ppid, ... utime is the 14th field.
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def server_cpu_seconds(server: int) -> float:
    """CPU seconds of a forking server (the postmaster): its own, its live
    children's, and those of children that exited (backends of closed connections)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_pid(int(entry)) == server:
            total += cpu_seconds(int(entry))
    return total + cpu_seconds(server, reaped_children=True)


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
