"""Retention settings and the horizon, without I/O."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from payhook.errors import SettingsError
from payhook.horizon import (
    REDELIVERY_MARGIN,
    beyond_horizon,
    describe,
    minimum_receipt_retention,
    receipt_horizon,
    redelivery_windows,
)
from payhook.settings import Settings


def test_receipt_retention_defaults_to_400_days_and_other_retentions_have_their_own() -> None:
    s = Settings.from_env({})
    assert s.receipt_retention == 400 * 86400
    assert s.outbox_retention == 30 * 86400
    assert s.exception_retention == s.anomaly_retention == 400 * 86400
    assert s.retention_batch == 500


def test_minimum_receipt_retention_is_the_longest_redelivery_window_plus_the_margin() -> None:
    minimum, gateway = minimum_receipt_retention()
    assert gateway == "stripe"
    assert minimum == max(redelivery_windows().values()) + REDELIVERY_MARGIN == 37 * 86400


@pytest.mark.parametrize("value", ["3d", "30d", "36d", "100", "871h"])
def test_receipt_retention_inside_the_redelivery_window_is_refused_by_name(value: str) -> None:
    with pytest.raises(SettingsError, match=r"^PAYHOOK_RECEIPT_RETENTION: .*at least 37d"):
        Settings.from_env({"PAYHOOK_RECEIPT_RETENTION": value})


def test_receipt_retention_at_or_beyond_the_minimum_is_accepted() -> None:
    assert Settings.from_env({"PAYHOOK_RECEIPT_RETENTION": "37d"}).receipt_retention == 37 * 86400
    assert Settings.from_env({"PAYHOOK_RECEIPT_RETENTION": "2000d"}).receipt_retention == (
        2000 * 86400
    )


@pytest.mark.parametrize(
    ("name", "attr"),
    [
        ("PAYHOOK_OUTBOX_RETENTION", "outbox_retention"),
        ("PAYHOOK_EXCEPTION_RETENTION", "exception_retention"),
        ("PAYHOOK_ANOMALY_RETENTION", "anomaly_retention"),
    ],
)
def test_other_retentions_parse_durations_and_name_themselves_when_bad(
    name: str, attr: str
) -> None:
    assert getattr(Settings.from_env({name: "12h"}), attr) == 12 * 3600
    with pytest.raises(SettingsError, match=f"^{name}:"):
        Settings.from_env({name: "a while"})


@pytest.mark.parametrize(
    ("name", "too_short", "least"),
    [
        ("PAYHOOK_ENDPOINT_REFRESH", "0", "0.1s"),
        ("PAYHOOK_ENQUEUE_TIMEOUT", "0s", "10ms"),
        ("PAYHOOK_RESULT_TTL", "0.5", "1s"),
        ("PAYHOOK_OUTBOX_SLA", "0", "1s"),
        ("PAYHOOK_OUTBOX_RETENTION", "0", "1h"),
        ("PAYHOOK_EXCEPTION_RETENTION", "59m", "1h"),
        ("PAYHOOK_ANOMALY_RETENTION", "0d", "1h"),
    ],
)
def test_durations_that_make_no_sense_are_refused_by_name(
    name: str, too_short: str, least: str
) -> None:
    """Zero would reload the endpoint table in a loop, answer every webhook
    503, or delete rows (and their alerts) as soon as they are written."""
    with pytest.raises(SettingsError, match=f"^{name}: expected at least"):
        Settings.from_env({name: too_short})
    Settings.from_env({name: least})


def test_retention_batch_must_be_a_positive_number() -> None:
    assert Settings.from_env({"PAYHOOK_RETENTION_BATCH": "50"}).retention_batch == 50
    with pytest.raises(SettingsError, match=r"^PAYHOOK_RETENTION_BATCH:"):
        Settings.from_env({"PAYHOOK_RETENTION_BATCH": "0"})


def test_an_event_older_than_the_horizon_is_beyond_it() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    horizon = receipt_horizon(400 * 86400, now)
    assert horizon == now - timedelta(days=400)
    assert beyond_horizon(horizon - timedelta(seconds=1), horizon)
    assert not beyond_horizon(horizon, horizon)
    assert not beyond_horizon(now, horizon)
    assert not beyond_horizon(None, horizon), "an event without a timestamp cannot be judged"


def test_durations_are_described_as_an_operator_writes_them() -> None:
    assert [describe(s) for s in (37 * 86400, 36 * 3600, 90, 1.5)] == ["37d", "36h", "90s", "1.5s"]
