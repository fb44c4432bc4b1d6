"""The worker's `PAYHOOK_OUTBOX_*` settings."""

from __future__ import annotations

import ipaddress

import pytest

from outbox_worker.config import OutboxSettings
from payhook.destinations import DestinationPolicy
from payhook.errors import SettingsError
from payhook.settings import Settings


def config(**env: str) -> OutboxSettings:
    return OutboxSettings.from_settings(Settings.from_env(env))


def test_defaults_suit_a_payment_operator() -> None:
    c = config()
    assert (c.lease, c.batch, c.concurrency, c.poll) == (60, 20, 10, 5)
    assert (c.timeout, c.max_attempts, c.backoff, c.backoff_max) == (10, 30, 5, 3600)


def test_overrides_accept_durations_with_units() -> None:
    c = config(
        PAYHOOK_OUTBOX_LEASE="2m",
        PAYHOOK_OUTBOX_BATCH="5",
        PAYHOOK_OUTBOX_CONCURRENCY="3",
        PAYHOOK_OUTBOX_POLL="250ms",
        PAYHOOK_OUTBOX_TIMEOUT="3s",
        PAYHOOK_OUTBOX_MAX_ATTEMPTS="4",
        PAYHOOK_OUTBOX_BACKOFF="100ms",
        PAYHOOK_OUTBOX_BACKOFF_MAX="1m",
    )
    assert (c.lease, c.batch, c.concurrency, c.poll) == (120, 5, 3, 0.25)
    assert (c.timeout, c.max_attempts, c.backoff, c.backoff_max) == (3, 4, 0.1, 60)


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"PAYHOOK_OUTBOX_LEASE": "soon"}, "PAYHOOK_OUTBOX_LEASE"),
        ({"PAYHOOK_OUTBOX_LEASE": "0s"}, "PAYHOOK_OUTBOX_LEASE"),
        ({"PAYHOOK_OUTBOX_BATCH": "0"}, "PAYHOOK_OUTBOX_BATCH"),
        ({"PAYHOOK_OUTBOX_CONCURRENCY": "many"}, "PAYHOOK_OUTBOX_CONCURRENCY"),
        ({"PAYHOOK_OUTBOX_POLL": "-1"}, "PAYHOOK_OUTBOX_POLL"),
        ({"PAYHOOK_OUTBOX_TIMEOUT": "0ms"}, "PAYHOOK_OUTBOX_TIMEOUT"),
        ({"PAYHOOK_OUTBOX_MAX_ATTEMPTS": "-3"}, "PAYHOOK_OUTBOX_MAX_ATTEMPTS"),
        ({"PAYHOOK_OUTBOX_BACKOFF": "x"}, "PAYHOOK_OUTBOX_BACKOFF"),
        ({"PAYHOOK_OUTBOX_BACKOFF_MAX": "1s"}, "PAYHOOK_OUTBOX_BACKOFF_MAX"),
        ({"PAYHOOK_OUTBOX_LEASE": "20s"}, "PAYHOOK_OUTBOX_LEASE"),
    ],
)
def test_bad_setting_names_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(SettingsError, match=name):
        config(**env)


@pytest.mark.parametrize(
    ("env", "size"),
    [
        ({}, 11),
        ({"PAYHOOK_OUTBOX_CONCURRENCY": "2"}, 4),
        ({"PAYHOOK_OUTBOX_CONCURRENCY": "30", "PAYHOOK_DB_POOL_SIZE": "8"}, 31),
        ({"PAYHOOK_OUTBOX_CONCURRENCY": "3", "PAYHOOK_DB_POOL_SIZE": "12"}, 12),
    ],
)
def test_pool_has_a_connection_for_every_delivery_and_the_claims(
    env: dict[str, str], size: int
) -> None:
    """A delivered row whose result cannot get a connection stays claimed and is sent again."""
    from outbox_worker.main import pool_size

    settings = Settings.from_env(env)
    assert pool_size(settings, OutboxSettings.from_settings(settings)) == size


def test_the_worker_reads_where_deliveries_may_go() -> None:
    assert config().destinations == DestinationPolicy()
    c = config(
        PAYHOOK_ALLOW_INSECURE_FULFILMENT="1", PAYHOOK_FULFILMENT_ALLOW_NETWORKS="10.20.0.0/16"
    )
    assert c.destinations.allow_insecure
    assert c.destinations.allow_networks == (ipaddress.ip_network("10.20.0.0/16"),)
    with pytest.raises(SettingsError, match=r"^PAYHOOK_FULFILMENT_ALLOW_NETWORKS: "):
        config(PAYHOOK_FULFILMENT_ALLOW_NETWORKS="10.20.0.0/16,10.0.0.300/8")
