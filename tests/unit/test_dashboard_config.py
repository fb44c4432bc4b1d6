"""Where the dashboard listens and with which credentials: no I/O."""

from __future__ import annotations

import pytest

from control.dashboard import DashboardSettings, display_url, is_loopback
from payhook.errors import SettingsError
from payhook.settings import Settings


def config(**env: str) -> DashboardSettings:
    return DashboardSettings.from_settings(Settings.from_env(env))


def test_it_listens_on_loopback_unless_told_otherwise() -> None:
    bound = config().bound(None, None)
    assert (bound.host, bound.port, bound.user, bound.password) == (
        "127.0.0.1",
        9181,
        "payhook",
        None,
    )


def test_another_address_needs_a_password() -> None:
    for host in ("0.0.0.0", "::", "192.0.2.10", "dashboard.internal"):
        with pytest.raises(SettingsError, match="PAYHOOK_DASHBOARD_PASSWORD"):
            config().bound(host, None)
        with pytest.raises(SettingsError, match="PAYHOOK_DASHBOARD_PASSWORD"):
            config(PAYHOOK_DASHBOARD_HOST=host).bound(None, None)
    bound = config(PAYHOOK_DASHBOARD_PASSWORD="s3cret").bound("0.0.0.0", 9000)
    assert (bound.host, bound.port) == ("0.0.0.0", 9000)


def test_the_password_never_shows_in_a_repr() -> None:
    assert "s3cret" not in repr(config(PAYHOOK_DASHBOARD_PASSWORD="s3cret"))


def test_bad_settings_name_themselves() -> None:
    with pytest.raises(SettingsError, match="PAYHOOK_DASHBOARD_USER"):
        config(PAYHOOK_DASHBOARD_USER="a:b")
    with pytest.raises(SettingsError, match="PAYHOOK_DASHBOARD_PORT"):
        config(PAYHOOK_DASHBOARD_PORT="http")


def test_loopback_addresses() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com"]))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://localhost", "redis://localhost"),
        ("redis://default:pw-1@redis:6379/2", "redis://redis:6379/2"),
        ("redis://:p%40w-1@redis:6379/2", "redis://redis:6379/2"),
        ("redis://default:pw@-1@redis:6379/2", "redis://redis:6379/2"),
        ("redis://redis:6379/2?username=default&password=pw-1", "redis://redis:6379/2"),
        ("redis://redis:6379?db=3&password=pw-1", "redis://redis:6379?db=3"),
        ("rediss://default:pw-1@[::1]:6380/1?ssl_cert_reqs=none", "rediss://[::1]:6380/1"),
        ("unix://default:pw-1@/run/redis.sock?db=4", "unix:///run/redis.sock?db=4"),
        # characters that end the userinfo early: the rest cannot be told from
        # the password (redis-py misreads these URLs too), so the scheme alone
        ("redis://default:pw/-1@redis:6379/2", "redis://"),
        ("redis://default:pw?-1@redis:6379/2", "redis://"),
        ("redis://default:pw#-1@redis:6379/2", "redis://"),
        ("redis://default:1234/5678@redis:6379/0", "redis://"),
        ("redis://default:2024?x@redis:6379/0", "redis://"),
        ("redis://:6379#abc@redis:6379/0", "redis://"),
        ("unix://default:pw/-1@/run/redis.sock", "unix://"),
        ("unix://:6379?x@/run/redis.sock", "unix://"),
    ],
)
def test_the_dashboard_shows_a_redis_url_without_its_credentials(url: str, shown: str) -> None:
    assert display_url(url) == shown
    assert "pw" not in display_url(url) and "-1" not in display_url(url)
    for part in ("1234", "5678", "2024", "6379#", "abc", "default"):
        assert part not in display_url(url)
