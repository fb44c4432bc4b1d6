"""compose.yaml and the Dockerfile, checked without Docker (which does not run here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from control.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
#: The payhook services and how many of each compose runs.
REPLICAS = {
    "migrate": 1,
    "ingress": 2,
    "consumer": 3,
    "outbox-worker": 2,
    "reconciler": 1,
    "dashboard": 1,
}


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return document


def test_services_replicas_and_one_image() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", "redis", "prometheus", "grafana", *REPLICAS}
    for name, replicas in REPLICAS.items():
        service = services[name]
        assert service["image"] == "payhook:latest" and service["build"] == ".", name
        assert service.get("deploy", {}).get("replicas", 1) == replicas, name
        assert service["environment"]["DATABASE_URL"].startswith("postgresql://payhook:")
        assert service["environment"]["REDIS_URL"].startswith("redis://:")
    assert services["migrate"]["restart"] == "no"


def test_each_payhook_command_is_a_real_payhook_command() -> None:
    parser = build_parser()
    for name in REPLICAS:
        command = compose()["services"][name]["command"]
        args = parser.parse_args(command)
        assert args.command == command[0], name
    dashboard = parser.parse_args(compose()["services"]["dashboard"]["command"])
    assert dashboard.host == "0.0.0.0"
    assert "PAYHOOK_DASHBOARD_PASSWORD" in compose()["services"]["dashboard"]["environment"]


def test_redis_syncs_every_write_and_needs_a_password() -> None:
    command = compose()["services"]["redis"]["command"]
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options["--appendonly"] == "yes"
    assert options["--appendfsync"] == "always"
    assert options["--requirepass"].startswith("${REDIS_PASSWORD:?")


def test_order_and_health() -> None:
    services = compose()["services"]
    for name in ("postgres", "redis", "ingress", "dashboard"):
        assert services[name]["healthcheck"]["test"], name
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("ingress", "consumer", "outbox-worker", "dashboard"):
        after = services[name]["depends_on"]
        assert after["migrate"]["condition"] == "service_completed_successfully", name
        assert after["redis"]["condition"] == "service_healthy", name
    assert set(compose()["volumes"]) == {"pgdata", "redisdata"}


def test_the_dockerfile_builds_one_image_whose_entrypoint_is_payhook() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["payhook"\]$', text, re.MULTILINE)
    assert re.search(r"^USER payhook$", text, re.MULTILINE)
    for folder in ("payhook", "ingress", "consumer", "outbox_worker", "sql"):
        assert f"COPY {folder} {folder}" in text
