"""The shipped Prometheus rules: they load, they name real signals, promtool passes them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from control.alerts import SIGNALS, AlertSettings, Signal, _duration
from payhook.errors import SettingsError
from payhook.settings import MAX_DURATION, Settings

RULES = Path(__file__).resolve().parents[2] / "ops" / "prometheus"
#: Metric names `control.alerts.AlertCollector` exports.
EXPORTED = {"payhook_alert_value", "payhook_alert_threshold", "payhook_alerts_up"}


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load((RULES / "alerts.yml").read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_every_signal_has_exactly_one_rule_and_every_rule_reads_exported_metrics() -> None:
    covered: list[str] = []
    for rule in rules():
        assert rule["alert"].startswith("Payhook")
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        metrics = set(re.findall(r"\b(payhook_[a-z_]+)\b", rule["expr"]))
        assert metrics and metrics <= EXPORTED, rule["expr"]
        named = set(re.findall(r'alert="([a-z_]+)"', rule["expr"]))
        if named:
            [signal] = named
            assert rule["expr"] == (
                f'payhook_alert_value{{alert="{signal}"}} > '
                f'payhook_alert_threshold{{alert="{signal}"}}'
            )
            covered.append(signal)
    assert sorted(covered) == sorted(SIGNALS)


def test_promtool_checks_and_unit_tests_pass() -> None:
    """promtool comes from Debian's `prometheus` package; the YAML checks above run without it."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "promtool is not installed: apt-get download prometheus, extract usr/bin/promtool"
        )
    for command in (
        [promtool, "check", "rules", "alerts.yml"],
        [promtool, "test", "rules", "alerts_test.yml"],
        [promtool, "check", "config", "prometheus.yml"],
    ):
        done = subprocess.run(command, cwd=RULES, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_signal_is_active_only_above_its_threshold() -> None:
    assert not Signal("serialization_retries", 20, 20, "").active
    assert Signal("serialization_retries", 21, 20, "").active
    assert Signal("digest_conflicts", 1, 0, "x").line() == "digest_conflicts 1 x"


def test_alert_settings_are_read_and_checked() -> None:
    config = AlertSettings.from_settings(
        Settings.from_env(
            {
                "PAYHOOK_ALERT_WINDOW": "1h",
                "PAYHOOK_ALERT_RETRY_WINDOW": "30m",
                "PAYHOOK_ALERT_RETRY_THRESHOLD": "5",
                "PAYHOOK_OUTBOX_SLA": "2m",
                "PAYHOOK_ALERT_BACKLOG": "10m",
            }
        )
    )
    assert config == AlertSettings(
        window=3600, retry_window=1800, retry_threshold=5, outbox_sla=120, backlog=600
    )
    assert AlertSettings.from_settings(Settings.from_env({})).backlog == 300
    with pytest.raises(SettingsError, match="PAYHOOK_ALERT_RETRY_WINDOW"):
        AlertSettings.from_settings(Settings.from_env({"PAYHOOK_ALERT_RETRY_WINDOW": "3h"}))
    with pytest.raises(SettingsError, match="PAYHOOK_ALERT_RETRY_THRESHOLD"):
        AlertSettings.from_settings(Settings.from_env({"PAYHOOK_ALERT_RETRY_THRESHOLD": "-1"}))
    for bad in ("0s", "soon"):
        with pytest.raises(SettingsError, match="PAYHOOK_ALERT_BACKLOG"):
            AlertSettings.from_settings(Settings.from_env({"PAYHOOK_ALERT_BACKLOG": bad}))
    assert [_duration(s) for s in (86400, 172800, 900, 90)] == ["24h", "2d", "15m", "90s"]


def test_windows_postgresql_cannot_use_are_refused_at_start() -> None:
    """A window of thousands of years would fail every read as if PostgreSQL
    were down; it stops the process with the variable's name instead. The
    bound is the one on every duration, enforced where settings are read."""
    for name in ("PAYHOOK_ALERT_WINDOW", "PAYHOOK_OUTBOX_SLA", "PAYHOOK_ALERT_BACKLOG"):
        for absurd in ("3000000d", "36501d", "36500.01d", "9" * 400):
            with pytest.raises(
                SettingsError, match=rf"{name}: expected at most 36500d \(100 years\)"
            ):
                AlertSettings.from_settings(Settings.from_env({name: absurd}))
    longest = AlertSettings.from_settings(
        Settings.from_env({"PAYHOOK_ALERT_WINDOW": "36500d", "PAYHOOK_ALERT_BACKLOG": "36500d"})
    )
    assert longest.window == longest.backlog == MAX_DURATION == 36500 * 86400


def test_the_read_timeout_is_read_and_checked() -> None:
    assert AlertSettings.from_settings(Settings.from_env({})).timeout == 5
    read = AlertSettings.from_settings(Settings.from_env({"PAYHOOK_ALERT_TIMEOUT": "250ms"}))
    assert read.timeout == 0.25
    for bad in ("0s", "soon", "11m"):
        with pytest.raises(SettingsError, match="PAYHOOK_ALERT_TIMEOUT"):
            AlertSettings.from_settings(Settings.from_env({"PAYHOOK_ALERT_TIMEOUT": bad}))
