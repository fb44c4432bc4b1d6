"""Bounds every duration setting shares, without I/O."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from control.alerts import AlertSettings
from payhook.errors import SettingsError
from payhook.horizon import receipt_horizon
from payhook.settings import DURATIONS, MAX_DURATION, MAX_JOB_TIMEOUT, Settings, parse_duration

RETENTIONS = (
    "PAYHOOK_RECEIPT_RETENTION",
    "PAYHOOK_OUTBOX_RETENTION",
    "PAYHOOK_EXCEPTION_RETENTION",
    "PAYHOOK_ANOMALY_RETENTION",
)


@pytest.mark.parametrize("name", sorted(name for name, _ in DURATIONS.values()))
def test_a_duration_beyond_a_century_is_refused_at_start_by_name(name: str) -> None:
    """`3000000d` would be accepted, then fail every job (`OverflowError`) and
    every retention run (`timestamp out of range`): it stops the process first."""
    with pytest.raises(
        SettingsError, match=rf"^{name}: expected at most 36500d \(100 years\), got '3000000d'$"
    ):
        Settings.from_env({name: "3000000d"})


@pytest.mark.parametrize("raw", ["36501d", "876025h", "3153600001", "9" * 400 + "d"])
def test_anything_past_the_bound_is_refused_however_it_is_written(raw: str) -> None:
    with pytest.raises(SettingsError, match=r"^PAYHOOK_RECEIPT_RETENTION: expected at most 36500d"):
        Settings.from_env({"PAYHOOK_RECEIPT_RETENTION": raw})


def test_the_longest_retentions_are_accepted_and_leave_a_horizon_to_compare_with() -> None:
    settings = Settings.from_env(dict.fromkeys(RETENTIONS, "36500d"))
    assert settings.receipt_retention == settings.anomaly_retention == MAX_DURATION
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert receipt_horizon(settings.receipt_retention, now) == datetime(1926, 1, 26, tzinfo=UTC)
    assert receipt_horizon(settings.receipt_retention).year > 1900


def test_the_alert_window_is_bounded_like_every_duration() -> None:
    """`PAYHOOK_ALERT_WINDOW` is read by `control.alerts` through the same parser."""
    with pytest.raises(SettingsError, match=r"^PAYHOOK_ALERT_WINDOW: expected at most 36500d"):
        AlertSettings.from_settings(Settings.from_env({"PAYHOOK_ALERT_WINDOW": "3000000d"}))
    longest = Settings.from_env({"PAYHOOK_ALERT_WINDOW": "36500d"})
    assert AlertSettings.from_settings(longest).window == MAX_DURATION


def test_a_command_line_duration_is_bounded_too() -> None:
    with pytest.raises(SettingsError, match=r"^--since: expected at most 36500d"):
        parse_duration("--since", "100000d")
    assert parse_duration("--since", "36500d") == MAX_DURATION


def test_the_job_timeout_is_at_most_a_day_as_consumers_accept() -> None:
    assert Settings.from_env({"PAYHOOK_JOB_TIMEOUT": str(MAX_JOB_TIMEOUT)}).job_timeout == 86_400
    with pytest.raises(
        SettingsError, match=r"^PAYHOOK_JOB_TIMEOUT: expected at most 86400 seconds, got 86401$"
    ):
        Settings.from_env({"PAYHOOK_JOB_TIMEOUT": "86401"})
