"""The consumer's view of webhook endpoints, cached for a few seconds per process."""

from __future__ import annotations

import time
from datetime import datetime

import psycopg
import structlog

from payhook.db import Row, fetch_one
from payhook.endpoints import Endpoint, open_credentials, open_secret, open_secrets
from payhook.gateways import GATEWAYS
from payhook.sealing import Keyring

log = structlog.get_logger(__name__)

#: Seconds an endpoint's secrets are trusted before they are read again.
ENDPOINT_TTL = 5.0


class EndpointCache:
    """Endpoints by id. A rotated-in secret is found at once (a failed
    verification re-reads the row); a retired one stops verifying within
    ENDPOINT_TTL seconds. Sealed secrets are opened with `keyring` as they are
    read; one that does not open verifies nothing."""

    def __init__(self, keyring: Keyring, ttl: float = ENDPOINT_TTL) -> None:
        self.keyring = keyring
        self.ttl = ttl
        self._entries: dict[str, tuple[Endpoint, float]] = {}

    def get(
        self, conn: psycopg.Connection[Row], endpoint_id: str, *, fresh: bool = False
    ) -> tuple[Endpoint | None, bool]:
        """The endpoint (None if unknown) and whether it was just read from the database."""
        hit = self._entries.get(endpoint_id)
        if hit is not None and not fresh and time.monotonic() - hit[1] < self.ttl:
            return hit[0], False
        row = fetch_one(conn, "get_endpoint", {"endpoint_id": endpoint_id})
        if row is not None and row["gateway"] not in GATEWAYS:
            # Written by a later release, or by hand: unknown to this one.
            log.warning("endpoint_gateway_unknown", endpoint_id=endpoint_id)
            row = None
        if row is None:
            self._entries.pop(endpoint_id, None)
            return None, True
        tenant_id, found_id = str(row["tenant_id"]), str(row["id"])
        retired = (
            (open_secret(self.keyring, tenant_id, found_id, r["secret"]), r["retired_at"])
            for r in row["retired_secrets"]
            if isinstance(r.get("secret"), str)  # a NULL written by hand is no secret
        )
        endpoint = Endpoint(
            id=found_id,
            tenant_id=tenant_id,
            gateway=row["gateway"],
            secrets=open_secrets(self.keyring, tenant_id, found_id, row["secrets"]),
            retired=tuple(
                (secret, datetime.fromisoformat(at)) for secret, at in retired if secret is not None
            ),
            settings=row["settings"],
            credentials=open_credentials(self.keyring, tenant_id, found_id, row["credentials"]),
        )
        self._entries[endpoint_id] = (endpoint, time.monotonic())
        return endpoint, True
