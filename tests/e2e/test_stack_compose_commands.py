"""Every command compose.yaml runs starts when run directly (Docker does not run here)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from redis import Redis
from rq import Worker

from payhook.settings import Settings
from tests.processes import process_env, start, stop, wait_until

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def compose_command(service: str, port: int) -> list[str]:
    """The service's command, on 127.0.0.1 and a free port instead of 0.0.0.0 and its own."""
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    command = list(services[service]["command"])
    for option, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        if option in command:
            command[command.index(option) + 1] = value
    return command


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_each_compose_command_starts(settings: Settings, redis_conn: Redis, tmp_path: Path) -> None:
    env = process_env(
        settings,
        PAYHOOK_ENV="production",
        PAYHOOK_DASHBOARD_USER="payhook",
        PAYHOOK_DASHBOARD_PASSWORD="compose-test",
    )
    migrate = subprocess.run(
        [sys.executable, "-m", "control.cli", *compose_command("migrate", 0)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert migrate.returncode == 0, migrate.stderr

    ports = {"ingress": free_port(), "dashboard": free_port()}
    ready = {
        "ingress": lambda: answers(f"http://127.0.0.1:{ports['ingress']}/readyz"),
        "dashboard": lambda: answers(f"http://127.0.0.1:{ports['dashboard']}/healthz"),
        "consumer": lambda: len(Worker.all(connection=redis_conn)) == 1,
        "outbox-worker": lambda: (
            "outbox_worker_started" in (tmp_path / "outbox-worker.log").read_text()
        ),
        "reconciler": lambda: "reconcile_off" in (tmp_path / "reconciler.log").read_text(),
    }
    running = {}
    try:
        for name in ready:
            command = compose_command(name, ports.get(name, 0))
            running[name] = start(command, env, tmp_path / f"{name}.log")
        for name, check in ready.items():
            wait_until(check, 60, f"{name} to start")
            assert running[name].poll() is None, (tmp_path / f"{name}.log").read_text()
    finally:
        codes = {name: stop(process, signal.SIGTERM) for name, process in running.items()}
    # uvicorn finishes its graceful shutdown, then dies of the signal it caught.
    assert "Finished server process" in (tmp_path / "ingress.log").read_text()
    codes["ingress"] = 0 if codes["ingress"] == -signal.SIGTERM else codes["ingress"]
    assert codes == dict.fromkeys(ready, 0), codes


def test_the_dashboard_refuses_a_public_address_without_a_password(settings: Settings) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "control.cli", "dashboard", "--host", "0.0.0.0", "--port", "18181"],
        env=process_env(settings),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2
    assert "PAYHOOK_DASHBOARD_PASSWORD" in refused.stderr
