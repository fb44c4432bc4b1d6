"""Ingress settings fail at start with the variable's name; tolerances cover every gateway."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import structlog
import uvicorn

from ingress.config import (
    DEFAULT_KEEP_ALIVE,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_RETRY_AFTER,
    IngressSettings,
)
from ingress.main import app_from_env, run
from ingress.protocol import ReadDeadlineProtocol
from payhook.errors import SettingsError
from payhook.gateways import GATEWAYS
from payhook.settings import Settings


def config(**env: str) -> IngressSettings:
    return IngressSettings.from_settings(Settings.from_env(env))


def test_retry_after_defaults_and_reads_durations() -> None:
    assert config().retry_after == DEFAULT_RETRY_AFTER
    assert config(PAYHOOK_INGRESS_RETRY_AFTER="30s").retry_after == 30
    assert config(PAYHOOK_INGRESS_RETRY_AFTER="1m").retry_after == 60
    assert config(PAYHOOK_INGRESS_RETRY_AFTER="1500ms").retry_after == 2


@pytest.mark.parametrize("raw", ["soon", "0", "-5s", ""])
def test_bad_retry_after_names_the_variable(raw: str) -> None:
    with pytest.raises(SettingsError, match="PAYHOOK_INGRESS_RETRY_AFTER"):
        config(PAYHOOK_INGRESS_RETRY_AFTER=raw)


def test_read_timeout_defaults_and_reads_durations() -> None:
    assert config().read_timeout == DEFAULT_READ_TIMEOUT == 10
    assert config(PAYHOOK_READ_TIMEOUT="1s").read_timeout == 1
    assert config(PAYHOOK_READ_TIMEOUT="2500ms").read_timeout == 2.5
    assert config(PAYHOOK_READ_TIMEOUT="5m").read_timeout == 300


@pytest.mark.parametrize("raw", ["soon", "", "-1s", "0", "999ms", "301s", "1h"])
def test_bad_or_unreasonable_read_timeout_names_the_variable(raw: str) -> None:
    with pytest.raises(SettingsError, match="PAYHOOK_READ_TIMEOUT"):
        config(PAYHOOK_READ_TIMEOUT=raw)


def test_connection_limit_defaults_and_reads_numbers() -> None:
    assert config().limit_concurrency == DEFAULT_LIMIT_CONCURRENCY == 2048
    assert config(PAYHOOK_INGRESS_LIMIT_CONCURRENCY="50").limit_concurrency == 50


@pytest.mark.parametrize("raw", ["many", "", "1.5", "0", "1", "-3"])
def test_bad_connection_limit_names_the_variable(raw: str) -> None:
    """One would refuse every request: uvicorn counts the asking connection."""
    with pytest.raises(SettingsError, match="PAYHOOK_INGRESS_LIMIT_CONCURRENCY"):
        config(PAYHOOK_INGRESS_LIMIT_CONCURRENCY=raw)


def test_keep_alive_defaults_and_rounds_up_to_whole_seconds() -> None:
    assert config().keep_alive == DEFAULT_KEEP_ALIVE == 5
    assert config(PAYHOOK_INGRESS_KEEP_ALIVE="75s").keep_alive == 75
    assert config(PAYHOOK_INGRESS_KEEP_ALIVE="1500ms").keep_alive == 2


@pytest.mark.parametrize("raw", ["forever", "", "0", "500ms", "2h"])
def test_bad_keep_alive_names_the_variable(raw: str) -> None:
    with pytest.raises(SettingsError, match="PAYHOOK_INGRESS_KEEP_ALIVE"):
        config(PAYHOOK_INGRESS_KEEP_ALIVE=raw)


def test_every_gateway_that_signs_a_timestamp_has_a_tolerance() -> None:
    tolerances = {name: gateway.tolerance for name, gateway in GATEWAYS.items()}
    assert all(t is None or 0 < t <= 600 for t in tolerances.values())
    # These sign no timestamp; the others do.
    unsigned = {"adyen", "braintree", "checkout", "gocardless", "mollie", "razorpay", "square"}
    assert {name for name, t in tolerances.items() if t is None} == unsigned


def test_the_app_factory_freezes_start_up_objects_out_of_the_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Full collections under load otherwise scan every module and class again."""
    monkeypatch.setenv("DATABASE_URL", "postgresql://payhook@127.0.0.1:5432/payhook")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/15")
    gc.unfreeze()
    try:
        app_from_env()  # builds without I/O
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        structlog.reset_defaults()  # the factory configured logging


def test_the_server_is_run_with_the_read_deadline_and_the_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    given: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: given.update(options))
    env = {
        "PAYHOOK_READ_TIMEOUT": "3s",
        "PAYHOOK_INGRESS_LIMIT_CONCURRENCY": "50",
        "PAYHOOK_INGRESS_KEEP_ALIVE": "7s",
    }
    try:
        assert run(Settings.from_env(env), "127.0.0.1", 8000) == 0
    finally:
        structlog.reset_defaults()  # run configured logging
    assert given["http"].func is ReadDeadlineProtocol
    assert given["http"].keywords == {"read_timeout": 3.0}
    assert given["ws"] == "none"
    assert given["limit_concurrency"] == 50
    assert given["timeout_keep_alive"] == 7


def test_a_bad_setting_stops_the_server_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uvicorn, "run", lambda *args, **options: pytest.fail("uvicorn started"))
    with pytest.raises(SettingsError, match="PAYHOOK_READ_TIMEOUT"):
        run(Settings.from_env({"PAYHOOK_READ_TIMEOUT": "later"}), "127.0.0.1", 8000)
