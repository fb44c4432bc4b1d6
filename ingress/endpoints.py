"""The in-memory copy of the webhook endpoints, refreshed in the background.

Requests read only this copy: PostgreSQL is never on the request path. The
whole table is read at start; then every `settings.endpoint_refresh` seconds
one small query reads the counter that every change to the table moves
(`payhook.endpoint_version`), and the table is read again only when it moved,
or when FULL_RELOAD seconds have passed whatever it says. So a new endpoint or
a rotated secret works within one interval, an unknown id costs no query
whatever the traffic, a large table is not rebuilt (holding the event loop)
every interval, and while PostgreSQL is away the last good copy keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable

import psycopg
import structlog
from psycopg.rows import dict_row

from payhook.db import connection_kwargs
from payhook.endpoints import Endpoint, open_credentials, open_secret
from payhook.gateways import GATEWAYS
from payhook.queries import query
from payhook.sealing import Keyring, MissingKey, is_sealed
from payhook.settings import DEFAULT_DATABASE_ROLE, Secret

log = structlog.get_logger(__name__)

#: Seconds one refresh (connect and query) may take before it counts as failed.
REFRESH_TIMEOUT = 10.0
#: Seconds after which the whole table is read again even if its counter has
#: not moved (a change made with triggers off: a restore, a replica's apply).
FULL_RELOAD = 60.0


#: Reads the endpoints; None when they have not changed since its last read.
Loader = Callable[[], Awaitable[list[Endpoint] | None]]


class EndpointCache:
    """Endpoints by id; empty and not `loaded` until the first refresh succeeds."""

    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        #: `time.monotonic()` of the last successful refresh, None before the first.
        self.refreshed_at: float | None = None

    @property
    def loaded(self) -> bool:
        return self.refreshed_at is not None

    def __len__(self) -> int:
        return len(self._endpoints)

    def get(self, endpoint_id: str) -> Endpoint | None:
        return self._endpoints.get(endpoint_id)

    def replace(self, endpoints: Iterable[Endpoint]) -> None:
        self._endpoints = {endpoint.id: endpoint for endpoint in endpoints}
        self.refreshed_at = time.monotonic()

    def confirm(self) -> None:
        """The copy was found current: as fresh as if just read (once there is one)."""
        if self.refreshed_at is not None:
            self.refreshed_at = time.monotonic()

    def age(self) -> float | None:
        """Seconds since the last successful refresh."""
        return None if self.refreshed_at is None else time.monotonic() - self.refreshed_at


class PostgresEndpoints:
    """Reads the endpoints over one connection, reconnecting after a failure:
    all of them when their version moved since the last read, else nothing.
    Sealed secrets are opened here, so the cache holds them only in memory."""

    def __init__(
        self,
        database_url: str,
        keyring: Keyring,
        full_reload: float = FULL_RELOAD,
        role: str = DEFAULT_DATABASE_ROLE,
        pooled: bool = False,
    ) -> None:
        self._url = database_url
        self._role = role
        self._pooled = pooled
        self._keyring = keyring
        self._full_reload = full_reload
        self._conn: psycopg.AsyncConnection[psycopg.rows.DictRow] | None = None
        #: The version of the last full read, and when (monotonic) it was made.
        self._version: int | None = None
        self._read_at = 0.0
        #: What each stored secret opened to at the last full read, by tenant,
        #: endpoint and stored value: an unchanged value is not opened again
        #: (nor logged again when it does not open) while the copy is rebuilt.
        self._opened: dict[tuple[str, str, str], Secret | None] = {}
        #: The same for each endpoint's credentials, by their stored values.
        self._credentials: dict[tuple[str, str, str], dict[str, Secret]] = {}

    async def __call__(self) -> list[Endpoint] | None:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await psycopg.AsyncConnection.connect(
                    self._url,
                    **(
                        connection_kwargs(
                            "ingress", self._url, role=self._role, pooled=self._pooled
                        )
                        | {"row_factory": dict_row}
                    ),
                )
            if self._version is not None and time.monotonic() - self._read_at < self._full_reload:
                cursor = await self._conn.execute(query("endpoint_version"))
                current = await cursor.fetchone()
                if current is not None and current["version"] == self._version:
                    return None
            read_at = time.monotonic()
            cursor = await self._conn.execute(query("list_endpoints"))
            rows = await cursor.fetchall()
        except BaseException:
            await self.close()
            raise
        version = rows[0]["version"] if rows else None
        rows = [row for row in rows if row["id"] is not None]
        if not self._keyring and any(
            is_sealed(s) for row in rows for s in [*row["secrets"], *row["credentials"].values()]
        ):
            raise MissingKey()
        previous, self._opened = self._opened, {}
        previous_credentials, self._credentials = self._credentials, {}
        endpoints = []
        for row in rows:
            tenant_id, endpoint_id = str(row["tenant_id"]), str(row["id"])
            if row["gateway"] not in GATEWAYS:
                # Written by a later release, or by hand: not served (404).
                log.warning("endpoint_gateway_unknown", endpoint_id=endpoint_id)
                continue
            secrets = []
            for value in row["secrets"]:
                key = (tenant_id, endpoint_id, value)
                if key in previous:
                    secret = previous[key]
                else:
                    secret = open_secret(self._keyring, tenant_id, endpoint_id, value)
                self._opened[key] = secret
                if secret is not None:
                    secrets.append(secret)
            # Only what verifying reads: API tokens stay out of the ingress.
            known = GATEWAYS[row["gateway"]].settings
            stored = {
                name: value
                for name, value in row["credentials"].items()
                if name in known and known[name].verifies
            }
            key = (tenant_id, endpoint_id, json.dumps(stored, sort_keys=True))
            credentials = previous_credentials.get(key)
            if credentials is None:
                credentials = open_credentials(self._keyring, tenant_id, endpoint_id, stored)
            self._credentials[key] = credentials
            endpoints.append(
                Endpoint(
                    endpoint_id,
                    tenant_id,
                    row["gateway"],
                    tuple(secrets),
                    settings=row["settings"],
                    credentials=credentials,
                )
            )
        self._version, self._read_at = version, read_at
        return endpoints

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            await conn.close()


class Refresher:
    """Reloads the cache every `interval` seconds; a failure keeps the last good copy."""

    def __init__(
        self,
        cache: EndpointCache,
        load: Loader,
        interval: float,
        on_result: Callable[[bool], None] | None = None,
    ) -> None:
        self.cache = cache
        self.load = load
        self.interval = interval
        self._on_result = on_result

    async def refresh(self) -> bool:
        """One reload; whether it succeeded."""
        try:
            async with asyncio.timeout(REFRESH_TIMEOUT):
                endpoints = await self.load()
        except MissingKey as exc:
            # A configuration error, not an outage: the first load, at start,
            # stops the process with the message; later, the last copy serves.
            log.error("endpoints_refresh_failed", error=str(exc))
            self._report(False)
            if not self.cache.loaded:
                raise
            return False
        except Exception as exc:
            # The database away (psycopg.Error, OSError, TimeoutError) or
            # anything else: the last good copy serves and the loop goes on;
            # a refresh task that died would leave the cache unchanged for
            # good, retired secrets still verifying, with /readyz still ready.
            log.warning(
                "endpoints_refresh_failed",
                error=exc.__class__.__name__,
                cache_age_s=_round(self.cache.age()),
                endpoints=len(self.cache),
            )
            self._report(False)
            return False
        if endpoints is None:
            self.cache.confirm()
        else:
            first = not self.cache.loaded
            self.cache.replace(endpoints)
            if first:
                log.info("endpoints_loaded", endpoints=len(endpoints))
        self._report(True)
        return True

    async def run(self) -> None:
        """Refresh forever; the caller cancels the task to stop it."""
        while True:
            await asyncio.sleep(self.interval)
            await self.refresh()

    def _report(self, ok: bool) -> None:
        if self._on_result is not None:
            self._on_result(ok)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
