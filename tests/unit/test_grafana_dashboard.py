"""The Grafana dashboard compose loads: it reads only metrics payhook exports,
and every alert rule links to it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from control.flow_metrics import HELP
from ingress.metrics import Metrics as IngressMetrics
from payhook import flow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops" / "grafana" / "dashboards" / "payhook.json"
#: What the dashboard's /metrics exports (control.alerts, control.flow_metrics).
DASHBOARD_METRICS = {
    "payhook_alert_value",
    "payhook_alert_threshold",
    "payhook_alerts_up",
    "payhook_queue_depth",
    "payhook_queue_oldest_job_seconds",
    *(f"payhook_{name}_seconds{suffix}" for name in flow.NAMES
      for suffix in ("_bucket", "_count", "_sum")),
}  # fmt: skip


def exported() -> set[str]:
    """Every series name payhook's processes export."""
    names = set(DASHBOARD_METRICS)
    for metric in IngressMetrics().registry.collect():
        names |= {sample.name for sample in metric.samples} | {metric.name}
        if metric.type == "counter":
            names.add(f"{metric.name}_total")
        if metric.type == "histogram":
            names |= {f"{metric.name}{s}" for s in ("_bucket", "_count", "_sum")}
    return names


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_every_panel_reads_metrics_payhook_exports() -> None:
    known = exported()
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        for name in re.findall(r"\bpayhook_[a-z_]+", expr):
            assert name in known, f"{name} in {expr!r} is exported by nothing"
    assert set(HELP) == set(flow.NAMES)


def test_compose_provisions_the_dashboard_and_every_rule_links_to_it() -> None:
    data = dashboard()
    assert data["uid"] == "payhook"
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    mounts = services["grafana"]["volumes"]
    assert "./ops/grafana/dashboards:/var/lib/grafana/dashboards:ro" in mounts
    provider = yaml.safe_load(
        (ROOT / "ops/grafana/provisioning/dashboards/payhook.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load(
        (ROOT / "ops/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    uids = {p["datasource"]["uid"] for p in data["panels"]}
    assert uids == {source["datasources"][0]["uid"]}
    rules = yaml.safe_load((ROOT / "ops/prometheus/alerts.yml").read_text())
    for rule in rules["groups"][0]["rules"]:
        assert rule["annotations"]["dashboard"] == f"/d/{data['uid']}/payhook", rule["alert"]
