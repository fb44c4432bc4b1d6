"""Where Redis is: Sentinel settings checked at start, and the `WAIT` the
ingress's writer appends to each batch."""

from __future__ import annotations

import pytest
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.sentinel import SentinelConnectionPool as SyncSentinelPool

from ingress.enqueue import _wait_command, enqueue_replicas
from payhook.errors import SettingsError
from payhook.redis_client import Sentinels, async_pool, master_options, sync_client
from payhook.settings import Settings

SENTINELS = {
    "REDIS_URL": "redis://app:s3cret@ignored:6379/3",
    "PAYHOOK_REDIS_SENTINELS": "10.0.0.1:26379, sentinel-b:26380,[::1]:26381",
    "PAYHOOK_REDIS_MASTER": "payhook",
    "PAYHOOK_REDIS_SENTINEL_PASSWORD": "sentinel-pass",
}


def test_sentinels_are_read_from_the_settings() -> None:
    settings = Settings.from_env(SENTINELS)
    sentinels = Sentinels.from_settings(settings)
    assert sentinels is not None
    assert sentinels.addresses == (("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381))
    assert sentinels.master == "payhook"
    assert "sentinel-pass" not in repr(settings) and "sentinel-pass" not in repr(sentinels)
    # The URL gives the master's credentials and database, not its address.
    assert master_options(settings) == {"username": "app", "password": "s3cret", "db": 3}
    assert Sentinels.from_settings(Settings.from_env({})) is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"PAYHOOK_REDIS_MASTER": ""}, "PAYHOOK_REDIS_MASTER: required"),
        ({"PAYHOOK_REDIS_SENTINELS": "sentinel-a"}, "expected host:port"),
        ({"PAYHOOK_REDIS_SENTINELS": "sentinel-a:0"}, "port out of range"),
        ({"PAYHOOK_REDIS_SENTINELS": "a:26379,b:x"}, "expected host:port"),
        ({"REDIS_URL": "rediss://ignored/0"}, "TLS and sockets are not supported"),
    ],
)
def test_bad_sentinel_settings_are_refused_by_name(changes: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Sentinels.from_settings(Settings.from_env(SENTINELS | changes))


def test_every_client_asks_the_sentinels_when_there_are_some() -> None:
    settings = Settings.from_env(SENTINELS)
    client = sync_client(settings, socket_timeout=1)
    assert isinstance(client.connection_pool, SyncSentinelPool)
    assert client.connection_pool.service_name == "payhook"
    assert isinstance(async_pool(settings, blocking_timeout=1), SentinelConnectionPool)
    client.close()


def test_the_writer_waits_for_the_replicas_it_is_told_to() -> None:
    assert enqueue_replicas(Settings.from_env({})) == 0
    assert enqueue_replicas(Settings.from_env({"PAYHOOK_ENQUEUE_REPLICAS": "2"})) == 2
    with pytest.raises(SettingsError, match="PAYHOOK_ENQUEUE_REPLICAS"):
        enqueue_replicas(Settings.from_env({"PAYHOOK_ENQUEUE_REPLICAS": "-1"}))
    # Half the enqueue timeout, in milliseconds, as a RESP array.
    assert _wait_command(1, 2.0) == b"*3\r\n$4\r\nWAIT\r\n$1\r\n1\r\n$4\r\n1000\r\n"
    assert _wait_command(2, 0.001).endswith(b"$1\r\n1\r\n")
