"""Where Redis is: one URL, or the master a group of Sentinels names.

- `PAYHOOK_REDIS_SENTINELS`: `host:port` of each Sentinel, comma-separated;
  set, every process asks them where the master is;
- `PAYHOOK_REDIS_MASTER`: the master's service name in their configuration;
- `PAYHOOK_REDIS_SENTINEL_PASSWORD`: the Sentinels' own password, if any.

With Sentinels, `REDIS_URL` still gives the master's user, password and
database; its host and port are not used. A connection asks the Sentinels
for the master's address each time it connects, and one to a master that a
failover demoted (it answers `READONLY`) is dropped, so the next connection
finds the new master (redis-py's `SentinelManagedConnection`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis import Redis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.connection import parse_url
from redis.sentinel import Sentinel

from payhook.errors import SettingsError
from payhook.settings import Secret, Settings

#: Seconds a Sentinel may take to answer which node is the master.
SENTINEL_TIMEOUT = 1.0


@dataclass(frozen=True)
class Sentinels:
    """The Sentinels to ask, and the name of the master they watch."""

    addresses: tuple[tuple[str, int], ...]
    master: str
    password: Secret | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Sentinels | None:
        """The Sentinels the settings name; None when they name none."""
        raw = (settings.get("PAYHOOK_REDIS_SENTINELS") or "").strip()
        if not raw:
            return None
        addresses = tuple(_address(part.strip()) for part in raw.split(",") if part.strip())
        master = (settings.get("PAYHOOK_REDIS_MASTER") or "").strip()
        if not master:
            raise SettingsError(
                "PAYHOOK_REDIS_MASTER: required with PAYHOOK_REDIS_SENTINELS, the master's "
                "service name in the Sentinels' configuration"
            )
        if settings.redis_url.startswith(("rediss://", "unix://")):
            raise SettingsError(
                "REDIS_URL: with PAYHOOK_REDIS_SENTINELS, a redis:// URL giving the "
                "master's user, password and database (TLS and sockets are not supported)"
            )
        password = settings.get("PAYHOOK_REDIS_SENTINEL_PASSWORD") or None
        return cls(addresses, master, Secret(password) if password else None)

    def sentinel_options(self) -> dict[str, Any]:
        return {
            "socket_timeout": SENTINEL_TIMEOUT,
            "socket_connect_timeout": SENTINEL_TIMEOUT,
            **({"password": str(self.password)} if self.password else {}),
        }


def _address(part: str) -> tuple[str, int]:
    host, sep, port = part.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdecimal()):
        raise SettingsError(f"PAYHOOK_REDIS_SENTINELS: expected host:port entries, got {part!r}")
    number = int(port)
    if not 1 <= number <= 65535:
        raise SettingsError(f"PAYHOOK_REDIS_SENTINELS: port out of range in {part!r}")
    return host.strip("[]"), number


def master_options(settings: Settings) -> dict[str, Any]:
    """What `REDIS_URL` says of the master: its user, password and database."""
    given = parse_url(settings.redis_url)
    return {k: given[k] for k in ("username", "password", "db") if given.get(k) is not None}


def sync_client(settings: Settings, **options: Any) -> Redis:
    """A client of the queue's Redis, through the Sentinels when there are some."""
    sentinels = Sentinels.from_settings(settings)
    if sentinels is None:
        return Redis.from_url(settings.redis_url, **options)
    manager = Sentinel(sentinels.addresses, sentinel_kwargs=sentinels.sentinel_options())
    client: Redis = manager.master_for(
        sentinels.master, redis_class=Redis, **(master_options(settings) | options)
    )
    return client


def async_pool(
    settings: Settings, *, blocking_timeout: float | None = None, **options: Any
) -> aioredis.ConnectionPool:
    """A pool of asyncio connections to the queue's Redis, through the Sentinels
    when there are some. With `blocking_timeout`, a URL's pool makes a
    request past `max_connections` wait that long for a connection; a
    Sentinels' pool refuses it at once."""
    sentinels = Sentinels.from_settings(settings)
    if sentinels is None:
        if blocking_timeout is not None:
            return aioredis.BlockingConnectionPool.from_url(
                settings.redis_url, timeout=blocking_timeout, **options
            )
        return aioredis.ConnectionPool.from_url(settings.redis_url, **options)
    manager = AsyncSentinel(sentinels.addresses, sentinel_kwargs=sentinels.sentinel_options())
    return AsyncSentinelPool(sentinels.master, manager, **(master_options(settings) | options))
