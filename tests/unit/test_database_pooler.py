"""Behind a transaction pooler: what payhook sends, where each connection
goes, and the settings it refuses."""

from __future__ import annotations

import pytest

from payhook.db import connect, connection_kwargs
from payhook.errors import PoolerError, SettingsError
from payhook.settings import Settings

POOLED = "postgresql://payhook_consumer@pgbouncer:6432/payhook"
DIRECT = "postgresql://payhook_owner@postgres:5432/payhook"


def pooled_settings(**extra: str) -> Settings:
    return Settings.from_env(
        {
            "DATABASE_URL": POOLED,
            "PAYHOOK_DATABASE_POOLER": "transaction",
            "PAYHOOK_DATABASE_ROLE": "",
        }
        | extra
    )


def test_a_pooled_connection_sends_no_session_option_and_prepares_nothing() -> None:
    kwargs = connection_kwargs("consumer", POOLED, {"statement_timeout": "15000"}, pooled=True)
    assert "options" not in kwargs
    assert kwargs["prepare_threshold"] is None
    assert kwargs["application_name"] == "payhook-consumer"
    direct = connection_kwargs(
        "consumer", DIRECT, {"statement_timeout": "15000"}, role="payhook_app"
    )
    assert "-c role=payhook_app" in direct["options"]
    assert "-c statement_timeout=15000" in direct["options"]
    assert "prepare_threshold" not in direct


def test_pooler_settings_are_checked_at_start() -> None:
    assert Settings.from_env({}).database_pooler == "none"
    assert pooled_settings().database_pooler == "transaction"
    with pytest.raises(SettingsError, match="expected none or transaction"):
        Settings.from_env({"PAYHOOK_DATABASE_POOLER": "session"})
    # The role to switch to cannot pass a pooler: log in as a member of payhook_app.
    with pytest.raises(SettingsError, match="PAYHOOK_DATABASE_ROLE to empty"):
        Settings.from_env({"PAYHOOK_DATABASE_POOLER": "transaction"})
    with pytest.raises(SettingsError, match="PAYHOOK_DATABASE_DIRECT_URL"):
        pooled_settings(PAYHOOK_DATABASE_DIRECT_URL="mysql://x")
    settings = pooled_settings(PAYHOOK_DATABASE_DIRECT_URL=DIRECT)
    assert settings.direct_url == DIRECT
    assert DIRECT not in repr(settings)
    assert pooled_settings().direct_url == POOLED


def test_what_needs_a_session_of_its_own_is_refused_behind_a_pooler_without_a_direct_url() -> None:
    settings = pooled_settings()
    with pytest.raises(PoolerError, match="PAYHOOK_DATABASE_DIRECT_URL"):
        connect(settings, "outbox-listen", direct=True)
    with pytest.raises(PoolerError, match="PAYHOOK_DATABASE_DIRECT_URL"):
        connect(settings, "retention", options="-c lock_timeout=2s")
