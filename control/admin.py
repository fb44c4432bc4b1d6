"""Tenants, endpoints and orders: what operators create by hand."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import psycopg
from psycopg.types.json import Jsonb

from payhook.db import Row, execute, fetch_one, tenant_of, tenant_transaction
from payhook.destinations import DestinationPolicy, DestinationRefused, Resolve, resolve_host
from payhook.endpoints import open_credentials
from payhook.errors import NotFound, PayhookError
from payhook.gateways import generate_secret, get_gateway, standard
from payhook.gateways.base import NO_CONFIG, Config
from payhook.sealing import Keyring, credential_aad, endpoint_aad, tenant_aad

#: Days a retired secret still verifies jobs received before its retirement:
#: longer than a job stays in the dead-letter queue (payhook.queue.FAILURE_TTL).
RETIRED_SECRET_DAYS = 31
#: Largest order amount: PostgreSQL's bigint.
MAX_AMOUNT_MINOR = 2**63 - 1


class AlreadyExists(PayhookError):
    """A record with that identity already exists."""


@dataclass(frozen=True)
class NewEndpoint:
    endpoint_id: str
    secret: str
    url_path: str


def add_tenant(
    conn: psycopg.Connection[Row],
    name: str,
    fulfilment_url: str | None = None,
    *,
    keyring: Keyring,
    destinations: DestinationPolicy = DestinationPolicy(),  # noqa: B008 - frozen, the strict one
    resolve: Resolve = resolve_host,
) -> str:
    """Create a tenant, its signing secret sealed with `keyring`; its
    fulfilment URL, if any, must be one `destinations` allows (by default the
    strict policy: https to public addresses only)."""
    if not name.strip():
        raise PayhookError("a tenant needs a non-empty name")
    if fulfilment_url is not None:
        _check_url(fulfilment_url)
        _check_destination(fulfilment_url, destinations, resolve)
    tenant_id = str(uuid.uuid4())
    with tenant_transaction(conn, tenant_id):
        execute(
            conn,
            "insert_tenant",
            {
                "id": tenant_id,
                "name": name,
                "fulfilment_url": fulfilment_url,
                "signing_secret": keyring.seal(standard.generate_secret(), tenant_aad(tenant_id)),
            },
        )
    return tenant_id


def add_endpoint(
    conn: psycopg.Connection[Row],
    tenant_id: str,
    gateway: str,
    secret: str | None = None,
    *,
    keyring: Keyring,
    config: Config = NO_CONFIG,
) -> NewEndpoint:
    """A new endpoint of `gateway`, with `config`'s settings and credentials
    (sealed like its secret), checked by the gateway's module."""
    try:
        get_gateway(gateway).check_config(config)
    except ValueError as exc:
        raise PayhookError(f"--gateway {gateway}: {exc}") from None
    secret = _checked_secret(gateway, secret or _new_secret(gateway))
    tenant_id = _uuid(tenant_id, "--tenant")
    endpoint_id = str(uuid.uuid4())
    credentials = {
        name: keyring.seal(value, credential_aad(tenant_id, endpoint_id, name))
        for name, value in config.credentials.items()
    }
    try:
        with tenant_transaction(conn, tenant_id):
            execute(
                conn,
                "insert_endpoint",
                {
                    "tenant_id": tenant_id,
                    "id": endpoint_id,
                    "gateway": gateway,
                    "secrets": [keyring.seal(secret, endpoint_aad(tenant_id, endpoint_id))],
                    "settings": Jsonb(dict(config.settings)),
                    "credentials": Jsonb(credentials),
                },
            )
    except psycopg.errors.ForeignKeyViolation:
        raise NotFound(f"no tenant {tenant_id}") from None
    return NewEndpoint(endpoint_id, secret, f"/webhooks/{endpoint_id}")


def rotate_endpoint_secret(
    conn: psycopg.Connection[Row],
    endpoint_id: str,
    secret: str | None = None,
    *,
    keyring: Keyring,
) -> str:
    """Add a new secret in front of the old ones; both verify until retired."""
    with conn.transaction():
        row = fetch_one(conn, "get_endpoint", {"endpoint_id": _uuid(endpoint_id, "endpoint")})
        if row is None:
            raise NotFound(f"no endpoint {endpoint_id}")
        secret = _checked_secret(row["gateway"], secret or _new_secret(row["gateway"]))
        sealed = keyring.seal(secret, endpoint_aad(str(row["tenant_id"]), str(row["id"])))
        with tenant_transaction(conn, row["tenant_id"]):
            execute(conn, "add_endpoint_secret", {"id": endpoint_id, "secret": sealed})
    return secret


def _new_secret(gateway: str) -> str:
    try:
        return generate_secret(gateway)
    except ValueError as exc:  # a gateway that assigns its own (PayPal's webhook id)
        raise PayhookError(f"--secret: {exc}") from None


def _checked_secret(gateway: str, secret: str) -> str:
    """`secret`, if `gateway` can sign with it (the gateway's own rule)."""
    try:
        get_gateway(gateway).check_secret(secret)
    except ValueError as exc:
        raise PayhookError(f"--secret: {exc}") from None
    return secret


def configure_endpoint(
    conn: psycopg.Connection[Row],
    endpoint_id: str,
    *,
    keyring: Keyring,
    config: Config = NO_CONFIG,
    unset: tuple[str, ...] = (),
) -> dict[str, object]:
    """Set an endpoint's settings and credentials (rotating an API token, say):
    `config`'s are set, `unset`'s removed, the others kept; the result is
    checked by the gateway's module. What is stored, credentials by name only."""
    with conn.transaction():
        row = fetch_one(conn, "get_endpoint", {"endpoint_id": _uuid(endpoint_id, "endpoint")})
        if row is None:
            raise NotFound(f"no endpoint {endpoint_id}")
        tenant_id, found_id = str(row["tenant_id"]), str(row["id"])
        gateway = get_gateway(row["gateway"])
        unknown = [name for name in unset if name not in gateway.settings]
        if unknown:
            raise PayhookError(f"--unset: {row['gateway']} has no setting {unknown[0]!r}")
        settings = {k: v for k, v in row["settings"].items() if k not in unset}
        settings |= config.settings
        sealed = {k: v for k, v in row["credentials"].items() if k not in unset}
        opened: dict[str, str] = dict(open_credentials(keyring, tenant_id, found_id, sealed))
        opened |= config.credentials
        try:
            gateway.check_config(Config(settings, opened))
        except ValueError as exc:
            raise PayhookError(f"--gateway {row['gateway']}: {exc}") from None
        sealed |= {
            name: keyring.seal(value, credential_aad(tenant_id, found_id, name))
            for name, value in config.credentials.items()
        }
        with tenant_transaction(conn, tenant_id):
            execute(
                conn,
                "set_endpoint_config",
                {
                    "tenant_id": tenant_id,
                    "id": found_id,
                    "settings": Jsonb(settings),
                    "credentials": Jsonb(sealed),
                },
            )
    return {"endpoint_id": found_id, "settings": settings, "credentials": sorted(sealed)}


def retire_old_secrets(conn: psycopg.Connection[Row], endpoint_id: str) -> None:
    params = {"id": _uuid(endpoint_id, "endpoint"), "keep_days": RETIRED_SECRET_DAYS}
    with tenant_transaction(conn, tenant_of(conn, "webhook_endpoints", params["id"])):
        if execute(conn, "retire_endpoint_secrets", params) != 1:
            raise NotFound(f"no endpoint {endpoint_id}")


def add_order(
    conn: psycopg.Connection[Row],
    tenant_id: str,
    merchant_reference: str,
    gateway_order_id: str,
    amount_minor: int,
    currency: str,
) -> str:
    if not merchant_reference.strip():
        raise PayhookError("--merchant-ref may not be empty")
    if not gateway_order_id.strip():
        raise PayhookError("--gateway-order-id may not be empty")
    if not 0 < amount_minor <= MAX_AMOUNT_MINOR:
        raise PayhookError(
            f"--amount must be a positive number of minor units, at most {MAX_AMOUNT_MINOR}"
        )
    if not re.fullmatch("[A-Za-z]{3}", currency):
        raise PayhookError("--currency must be a three-letter code such as EUR")
    order_id = str(uuid.uuid4())
    tenant_id = _uuid(tenant_id, "--tenant")
    try:
        with tenant_transaction(conn, tenant_id):
            execute(
                conn,
                "insert_order",
                {
                    "tenant_id": tenant_id,
                    "id": order_id,
                    "merchant_reference": merchant_reference,
                    "gateway_order_id": gateway_order_id,
                    "amount_minor": amount_minor,
                    "currency": currency.upper(),
                },
            )
    except psycopg.errors.ForeignKeyViolation:
        raise NotFound(f"no tenant {tenant_id}") from None
    except psycopg.errors.UniqueViolation as exc:
        constraint = exc.diag.constraint_name or ""
        what = "merchant reference" if "merchant_reference" in constraint else "gateway order id"
        raise AlreadyExists(f"the tenant already has an order with that {what}") from None
    return order_id


def _check_url(url: str) -> None:
    """A URL the outbox worker can deliver to: http or https, a host a resolver
    can take (each label 1 to 63 characters once IDNA-encoded), no spaces."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
        if parts.hostname:
            parts.hostname.encode("idna")
    except (ValueError, UnicodeError):
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or any(c.isspace() for c in url)
    ):
        raise PayhookError(
            f"--fulfilment-url: expected an http:// or https:// URL with a host, got {url!r}"
        )


def _check_destination(url: str, destinations: DestinationPolicy, resolve: Resolve) -> None:
    """Refuse a URL the outbox worker would refuse to deliver to, as far as can be
    told now: a name that does not resolve yet is let through, since the worker
    checks every address again when it connects."""
    try:
        host, port = destinations.check_url(url)
        try:
            destinations.check_host(host, port, resolve)
        except OSError:
            pass
    except DestinationRefused as exc:
        raise PayhookError(f"--fulfilment-url: refused: {exc}") from None


def _uuid(value: str, name: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise PayhookError(f"{name}: expected a UUID, got {value!r}") from None
