"""A webhook endpoint as the ingress and the consumer hold it in memory."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import structlog

from payhook.gateways.base import Config
from payhook.sealing import Keyring, SealingError, credential_aad, endpoint_aad
from payhook.settings import Secret

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """One row of `webhook_endpoints`. Its secrets never show in a repr, nor
    does a repr of them: each is held as a `Secret`."""

    id: str
    tenant_id: str
    gateway: str
    #: Active secrets, newest first.
    secrets: tuple[str, ...] = field(repr=False)
    #: Retired secrets and when each was retired.
    retired: tuple[tuple[str, datetime], ...] = field(default=(), repr=False)
    #: The gateway's settings (`payhook.gateways.base.Setting`) and its
    #: credentials, opened.
    settings: Mapping[str, str] = field(default_factory=dict)
    credentials: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "secrets", tuple(Secret(s) for s in self.secrets))
        object.__setattr__(self, "retired", tuple((Secret(s), at) for s, at in self.retired))
        credentials = {name: Secret(value) for name, value in self.credentials.items()}
        object.__setattr__(self, "credentials", credentials)

    @property
    def config(self) -> Config:
        """What the endpoint's gateway reads beyond its secrets."""
        return Config(self.settings, self.credentials)

    def secrets_at(self, received_at: datetime, grace: timedelta) -> tuple[str, ...]:
        """The secrets that may have verified at the ingress when a job was
        received: the active ones, and those retired since or less than
        `grace` before (the ingress's endpoint cache lags the database, and
        `received_at` is the ingress's clock, `retired_at` the database's)."""
        since = received_at - grace
        return self.secrets + tuple(s for s, retired_at in self.retired if retired_at > since)


def open_secret(keyring: Keyring, tenant_id: str, endpoint_id: str, value: str) -> Secret | None:
    """An endpoint's stored secret opened; None, logged, when it does not open
    (a wrong key, or a value copied from another endpoint): that secret then
    verifies nothing, and the endpoint's other secrets still do."""
    try:
        return keyring.open(value, endpoint_aad(tenant_id, endpoint_id))
    except SealingError as exc:
        log.error(
            "endpoint_secret_unopenable",
            endpoint_id=endpoint_id,
            tenant_id=tenant_id,
            error=str(exc),
        )
        return None


def open_secrets(
    keyring: Keyring, tenant_id: str, endpoint_id: str, values: Iterable[str]
) -> tuple[str, ...]:
    """The stored secrets that open, in their order."""
    opened = (open_secret(keyring, tenant_id, endpoint_id, v) for v in values)
    return tuple(s for s in opened if s is not None)


def open_credentials(
    keyring: Keyring, tenant_id: str, endpoint_id: str, values: Mapping[str, str]
) -> dict[str, Secret]:
    """The stored credentials, opened, by name; one that does not open is
    logged and held empty: the gateway finds it configured, and nothing
    matches it (a password), or it is missing (a token)."""
    opened = {}
    for name, value in values.items():
        try:
            opened[name] = keyring.open(value, credential_aad(tenant_id, endpoint_id, name))
        except SealingError as exc:
            log.error(
                "endpoint_credential_unopenable",
                endpoint_id=endpoint_id,
                tenant_id=tenant_id,
                credential=name,
                error=str(exc),
            )
            opened[name] = Secret("")
    return opened
