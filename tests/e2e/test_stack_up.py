"""`payhook up` as a newcomer runs it: real services, real processes, nothing left behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import psycopg
import pytest

from payhook.settings import Settings
from tests.processes import process_env, wait_until
from tests.receiver import Receiver

#: Seconds `payhook up` may take to start embedded PostgreSQL and Redis and every process.
START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def newcomer_env() -> dict[str, str]:
    """A shell with no payhook configuration at all."""
    drop = {"DATABASE_URL", "REDIS_URL"}
    return {k: v for k, v in os.environ.items() if not k.startswith("PAYHOOK_") and k not in drop}


def start_up(
    args: list[str], env: dict[str, str], cwd: Path, *, nohup: bool = False
) -> tuple[subprocess.Popen[bytes], Path]:
    """`payhook up ARGS`, output to a log; with `nohup`, SIGHUP ignored, as `nohup` starts it."""

    def ignore_hangup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    log = cwd / "up.log"
    with log.open("wb") as handle:
        up = subprocess.Popen(
            [sys.executable, "-m", "control.cli", "up", *args],
            cwd=cwd,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            preexec_fn=ignore_hangup if nohup else None,
        )
    return up, log


def wait_for_banner(up: subprocess.Popen[bytes], log: Path) -> str:
    def ready() -> bool:
        return up.poll() is not None or "payhook is up" in log.read_text()

    wait_until(ready, START_TIMEOUT, "payhook up to start")
    text = log.read_text()
    assert up.poll() is None, text[-4000:]
    return text


def alive(processes: list[psutil.Process]) -> list[str]:
    """Those still running (zombies, already dead, do not count)."""
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            pass
    return left


def postgres_serving(pgdata: Path) -> list[str]:
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if process.info["name"] == "postgres" and any(str(pgdata) in part for part in cmdline):
            found.append(" ".join(cmdline))
    return found


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A fresh folder to run `payhook up` in. Not under pytest's own temporary folder:
    pytest makes that private (0700) whenever a run starts, and as root pgserver runs
    PostgreSQL as another user, who must reach the data folder."""
    folder = Path(tempfile.mkdtemp(prefix="payhook-up-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_newcomer_runs_up_sends_a_payment_and_stops_everything(workdir: Path) -> None:
    """Embedded PostgreSQL and Redis from the wheels, demo tenant, paid order, fulfilment."""
    tmp_path = workdir
    receiver = Receiver(tmp_path / "receiver").start()
    port, dashboard_port = free_port(), free_port()
    options = f"--embedded --port {port} --dashboard-port {dashboard_port}"
    up, log = start_up(
        [*options.split(), "--fulfilment-url", receiver.url], newcomer_env(), tmp_path
    )
    try:
        text = wait_for_banner(up, log)
        database_url = re.search(r"DATABASE_URL=(\S+)", text)
        assert database_url is not None, text
        assert "Redis: embedded valkey-server 8." in text
        assert "fulfilment to this machine allowed: PAYHOOK_ALLOW_INSECURE_FULFILMENT=1" in text
        children = psutil.Process(up.pid).children(recursive=True)
        commands = [" ".join(c.cmdline()) for c in children]
        for needed in ("ingress", "consumer", "outbox-worker", "dashboard", "valkey-server"):
            assert any(needed in command for command in commands), (needed, commands)
        direct = [" ".join(c.cmdline()) for c in psutil.Process(up.pid).children()]
        assert sum("control.cli consumer" in command for command in direct) == 2
        pgdata = tmp_path / ".payhook" / "pgdata"
        assert postgres_serving(pgdata)

        # The banner's own line, pasted into a shell.
        [send] = [
            line.split("| ", 1)[1].strip() for line in text.splitlines() if "payhook send" in line
        ]
        argv = shlex.split(send)
        assert argv[0] == "payhook"
        sent = subprocess.run(
            [sys.executable, "-m", "control.cli", *argv[1:]],
            env=newcomer_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert sent.returncode == 0, sent.stdout + sent.stderr

        wait_until(lambda: bool(receiver.requests()), 60, "the fulfilment delivery")
        [delivery] = receiver.requests()
        fulfilment = json.loads(delivery["body"])
        assert (fulfilment["merchant_reference"], fulfilment["state"]) == ("demo-1", "paid")
        assert delivery["headers"]["idempotency-key"].endswith(":fulfil_order")
        with psycopg.connect(database_url.group(1)) as conn:
            row = conn.execute(
                "SELECT state FROM payhook.payment_orders WHERE merchant_reference = 'demo-1'"
            ).fetchone()
        assert row == ("paid",)
        assert httpx.get(f"http://127.0.0.1:{dashboard_port}/").status_code == 401

        # The endpoint secret the banner shows is sealed in the database, under
        # the key `up` made in its state folder, readable by its owner alone.
        key_file = tmp_path / ".payhook" / "secrets.key"
        assert key_file.stat().st_mode & 0o777 == 0o600
        secret = argv[argv.index("--secret") + 1]
        with psycopg.connect(database_url.group(1)) as conn:
            stored = conn.execute("SELECT secrets FROM payhook.webhook_endpoints").fetchone()
        assert stored is not None and secret not in str(stored)
        assert stored[0][0].startswith("sealed:v1:k1:")

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, log.read_text()[-4000:]
        assert alive(children) == []
        assert postgres_serving(pgdata) == []
        assert log.read_text().rstrip().endswith("stopped; nothing left running")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        receiver.stop()


@pytest.mark.slow
def test_embedded_postgresql_outlives_a_killed_up_only_until_the_next_run_stops(
    workdir: Path,
) -> None:
    """SIGKILL cannot be caught: the embedded PostgreSQL stays, with the killed
    run still listed as holding it. The next run must not count that run, and
    stops PostgreSQL when it stops, here on SIGHUP (the terminal closed)."""
    pgdata = workdir / ".payhook" / "pgdata"

    def run_up() -> tuple[subprocess.Popen[bytes], Path]:
        args = ["--embedded", "--port", str(free_port()), "--dashboard-port", str(free_port())]
        up, log = start_up(args, newcomer_env(), workdir)
        wait_for_banner(up, log)
        return up, log

    first, _ = run_up()
    orphans = [
        child
        for child in psutil.Process(first.pid).children(recursive=True)
        if child.name() != "postgres"
    ]
    try:
        first.kill()
        first.wait(timeout=30)
        assert postgres_serving(pgdata), "SIGKILL leaves the embedded server running"
        # Its own children stop on their own, as their parent's death asks.
        wait_until(lambda: alive(orphans) == [], 30, "every child of the killed `up` to exit")
        second, log = run_up()
        try:
            children = psutil.Process(second.pid).children(recursive=True)
            second.send_signal(signal.SIGHUP)
            assert second.wait(timeout=60) == 0, log.read_text()[-4000:]
            assert alive(children) == []
            assert postgres_serving(pgdata) == []
        finally:
            if second.poll() is None:
                second.kill()
                second.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        for orphan in orphans:
            with contextlib.suppress(psutil.NoSuchProcess):
                orphan.kill()
        # Never leave a server behind a failed test.
        for process in psutil.process_iter(["name", "cmdline"]):
            if process.info["name"] == "postgres" and str(pgdata) in " ".join(
                process.info["cmdline"] or []
            ):
                process.kill()


@pytest.mark.slow
def test_up_uses_the_configured_services_and_stops_all_when_a_child_dies(
    settings: Settings, tmp_path: Path
) -> None:
    password = f"operators-own-{os.getpid()}"
    env = process_env(settings, PAYHOOK_DASHBOARD_PASSWORD=password, PAYHOOK_RECONCILE_EVERY="1h")
    up, log = start_up(
        ["--port", str(free_port()), "--dashboard-port", str(free_port()), "--consumers", "1"],
        env,
        tmp_path,
    )
    try:
        text = wait_for_banner(up, log)
        # A password the operator set is theirs to know: never printed.
        assert "password from PAYHOOK_DASHBOARD_PASSWORD" in text
        assert password not in text
        assert f"PostgreSQL: DATABASE_URL ({settings.database_url})" in text
        assert f"Redis: REDIS_URL ({settings.redis_url})" in text
        assert not (tmp_path / ".payhook").exists()
        children = psutil.Process(up.pid).children(recursive=True)
        # With PAYHOOK_RECONCILE_EVERY, reconciliation runs on its schedule too.
        assert any("reconcile --scheduled" in " ".join(c.cmdline()) for c in children)
        [outbox] = [c for c in children if "outbox-worker" in " ".join(c.cmdline())]
        outbox.kill()
        assert up.wait(timeout=60) == 1
        assert "outbox exited with status -9; stopping all" in log.read_text()
        assert alive(children) == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.slow
@pytest.mark.parametrize("nohup", [False, True])
def test_a_closed_terminal_stops_up_unless_it_runs_under_nohup(
    settings: Settings, tmp_path: Path, nohup: bool
) -> None:
    env = process_env(settings)
    args = ["--port", str(free_port()), "--dashboard-port", str(free_port()), "--consumers", "1"]
    up, log = start_up(args, env, tmp_path, nohup=nohup)
    try:
        wait_for_banner(up, log)
        children = psutil.Process(up.pid).children(recursive=True)
        up.send_signal(signal.SIGHUP)
        if nohup:
            with pytest.raises(subprocess.TimeoutExpired):
                up.wait(timeout=3)
            up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, log.read_text()[-4000:]
        assert alive(children) == []
        stopped_by = "SIGTERM: stopping" if nohup else "SIGHUP: stopping"
        assert stopped_by in log.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.slow
def test_children_stop_when_up_itself_is_killed(settings: Settings, tmp_path: Path) -> None:
    """SIGKILL leaves `up` no chance to clean up: its children must notice on their own."""
    env = process_env(settings)
    up, log = start_up(
        ["--port", str(free_port()), "--dashboard-port", str(free_port()), "--consumers", "1"],
        env,
        tmp_path,
    )
    try:
        wait_for_banner(up, log)
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 4
        up.kill()
        up.wait(timeout=10)
        wait_until(lambda: alive(children) == [], 30, "every child of the killed `up` to exit")
    finally:
        for child in psutil.Process().children(recursive=True):
            if child.pid != os.getpid():
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()


def test_a_state_dir_that_cannot_be_made_is_a_clear_error(workdir: Path) -> None:
    blocker = workdir / "a-file"
    blocker.write_text("")
    args = ["--embedded", "--state-dir", str(blocker / "state")]
    args += ["--port", str(free_port()), "--dashboard-port", str(free_port())]
    done = subprocess.run(
        [sys.executable, "-m", "control.cli", "up", *args],
        cwd=workdir,
        env=newcomer_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "payhook: error: --state-dir: cannot make" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
