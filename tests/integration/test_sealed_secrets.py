"""Secrets sealed at rest: what a dump holds, keys that do not fit, rows that
were copied, rotation and the upgrade from plaintext."""

from __future__ import annotations

import asyncio
import glob
import json
import subprocess
from dataclasses import replace

import psycopg
import pytest
from psycopg.types.json import Jsonb
from structlog.testing import capture_logs

from consumer import main as consumer_main
from consumer.endpoints import EndpointCache
from consumer.handler import Runtime, handle
from control import admin
from control.sealed import check_all, reseal_all
from ingress.endpoints import PostgresEndpoints
from outbox_worker import claims
from outbox_worker.main import check_key
from payhook.db import Row, create_pool
from payhook.endpoints import Endpoint
from payhook.gateways.base import Config
from payhook.sealing import (
    Keyring,
    MissingKey,
    endpoint_aad,
    generate_key_line,
    key_id_of,
    tenant_aad,
)
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, TEST_SECRETS_KEY, Factory, Shop, StandardEvent
from tests.locks import released_after
from tests.processes import run_cli


def pg_dump(settings: Settings) -> str:
    """The database as `pg_dump` writes it, with the server's own version of the tool."""
    with psycopg.connect(settings.database_url) as conn:
        server = conn.info.server_version // 10000
    [binary] = glob.glob(f"/usr/lib/postgresql/{server}/bin/pg_dump")
    return subprocess.run(
        [binary, "--dbname", settings.database_url],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


def tenant_secret(conn: psycopg.Connection[Row], shop: Shop) -> str:
    row = conn.execute(
        "SELECT signing_secret FROM payhook.tenants WHERE id = %s", (shop.tenant_id,)
    ).fetchone()
    assert row is not None
    return str(row["signing_secret"])


def stored_values(conn: psycopg.Connection[Row]) -> list[str]:
    """Every secret stored, sealed or not."""
    values = [
        str(r["signing_secret"]) for r in conn.execute("SELECT signing_secret FROM payhook.tenants")
    ]
    for row in conn.execute(
        "SELECT secrets, retired_secrets, credentials FROM payhook.webhook_endpoints"
    ):
        values += row["secrets"] + [r["secret"] for r in row["retired_secrets"]]
        values += list(row["credentials"].values())
    return values


def keys_settings(settings: Settings, keys: str) -> Settings:
    return replace(settings, extra=dict(settings.extra) | {"PAYHOOK_SECRETS_KEY": keys})


def test_a_dump_of_the_database_holds_none_of_the_secrets(
    settings: Settings, factory: Factory
) -> None:
    """Endpoint secrets (active and retired), given or generated, and tenants'
    signing secrets: the dump holds only sealed values."""
    conn = factory.conn
    standard, stripe = factory.shop("standard"), factory.shop("stripe")
    given = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    tenant = admin.add_tenant(conn, "given", keyring=TEST_KEYRING)
    chosen = admin.add_endpoint(conn, tenant, "stripe", given, keyring=TEST_KEYRING)
    rotated = admin.rotate_endpoint_secret(conn, standard.endpoint_id, keyring=TEST_KEYRING)
    admin.retire_old_secrets(conn, standard.endpoint_id)
    known = [standard.secret, stripe.secret, given, chosen.secret, rotated]
    known += [
        TEST_KEYRING.open(tenant_secret(conn, shop), tenant_aad(shop.tenant_id))
        for shop in (standard, stripe)
    ]
    dump = pg_dump(settings)
    assert "sealed:v1:test1:" in dump
    for secret in known:
        assert secret not in dump
        assert secret.removeprefix("whsec_") not in dump  # the key material alone
    assert all(value.startswith("sealed:v1:test1:") for value in stored_values(conn))


def test_secrets_check_passes_and_fails_loudly_with_a_wrong_key(
    settings: Settings, factory: Factory
) -> None:
    factory.shop()
    good = run_cli(settings, "secrets", "check")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout) == {
        "opened": 2,
        "by_key": {"test1": 2},
        "plaintext": [],
        "failures": [],
    }
    wrong = run_cli(settings, "secrets", "check", PAYHOOK_SECRETS_KEY=generate_key_line("test1"))
    assert wrong.returncode == 1
    failures = json.loads(wrong.stdout)["failures"]
    assert len(failures) == 2 and all("key test1 does not open" in f for f in failures)
    unknown = run_cli(settings, "secrets", "check", PAYHOOK_SECRETS_KEY=generate_key_line("k9"))
    assert unknown.returncode == 1 and "test1" in unknown.stdout


def test_a_sealed_secret_copied_to_another_endpoint_does_not_verify(
    runtime: Runtime, factory: Factory, settings: Settings
) -> None:
    """The consumer records what it records for a bad signature, and goes on."""
    victim, attacker = factory.shop(), factory.shop()
    factory.order(victim)
    factory.conn.execute(
        "UPDATE payhook.webhook_endpoints AS v SET secrets = a.secrets"
        "  FROM payhook.webhook_endpoints AS a WHERE v.id = %s AND a.id = %s",
        (victim.endpoint_id, attacker.endpoint_id),
    )
    forged = replace(victim, secret=attacker.secret)
    with capture_logs() as logs:
        outcome = handle(runtime, factory.standard_envelope(forged, StandardEvent()).to_json())
    assert outcome.outcome == "signature_invalid"
    assert factory.count("security_anomalies", kind="signature_invalid") == 1
    assert factory.count("payment_event_receipts") == 0
    [line] = [entry for entry in logs if entry["event"] == "endpoint_secret_unopenable"]
    assert line["endpoint_id"] == victim.endpoint_id and attacker.secret not in str(line)
    checked = check_all(factory.conn, TEST_KEYRING)
    assert not checked.ok and checked.failures[0].startswith(f"endpoints {victim.endpoint_id}")
    # The attacker's own endpoint still verifies.
    own = factory.standard_envelope(attacker, StandardEvent())
    assert handle(runtime, own.to_json()).outcome == "unmapped_order"


def test_a_tenant_secret_that_does_not_open_is_retried_naming_the_key(
    factory: Factory,
) -> None:
    shop = factory.shop()
    factory.outbox_rows(shop, factory.order(shop))
    [claim] = claims.claim_due_rows(
        factory.conn, 1, 60, Keyring.parse([("k", generate_key_line("test1"))])
    )
    assert claim.signing_secret is None and claim.secret_error is not None
    assert "key test1 does not open" in claim.secret_error


def test_rotate_key_reseals_everything_resumably_and_events_still_verify(
    settings: Settings, factory: Factory, runtime: Runtime
) -> None:
    shops = [factory.shop() for _ in range(5)]
    admin.rotate_endpoint_secret(factory.conn, shops[0].endpoint_id, keyring=TEST_KEYRING)
    admin.retire_old_secrets(factory.conn, shops[0].endpoint_id)
    rotated = keys_settings(settings, f"{generate_key_line('k2')},{TEST_SECRETS_KEY}")
    both = Keyring.from_settings(rotated)

    # Interrupted after one transaction of two rows: the rest is still under test1.
    first = reseal_all(factory.conn, both, batch=2, stop_after=1)
    assert first.resealed == 2 and first.remaining == 8
    ids = {key_id_of(v) for v in stored_values(factory.conn)}
    assert ids == {"k2", "test1"}
    # Run again: it goes on with what is left.
    second = reseal_all(factory.conn, both, batch=2)
    assert second.resealed == 8 and second.remaining == 0 and not second.failures
    assert {key_id_of(v) for v in stored_values(factory.conn)} == {"k2"}
    # 5 tenants' secrets, 5 active endpoint secrets and a retired one.
    assert check_all(factory.conn, both).by_key == {"k2": 11}
    assert not check_all(factory.conn, TEST_KEYRING).ok

    new_key_only = keys_settings(settings, rotated.extra["PAYHOOK_SECRETS_KEY"].split(",")[0])
    consumer = Runtime(settings=new_key_only, pool=runtime.pool, redis=runtime.redis)
    for shop in shops:
        event = StandardEvent()
        assert handle(consumer, factory.standard_envelope(shop, event).to_json()).outcome in (
            "unmapped_order",
            "applied",
        )


def test_plaintext_of_an_older_release_verifies_until_sealed_and_then_is_gone(
    settings: Settings, factory: Factory, runtime: Runtime
) -> None:
    """The upgrade: rows an older release wrote in plaintext keep working;
    `payhook secrets seal` seals them, online and in batches."""
    shop = factory.shop()
    signing = TEST_KEYRING.open(tenant_secret(factory.conn, shop), tenant_aad(shop.tenant_id))
    factory.conn.execute(
        "UPDATE payhook.webhook_endpoints SET secrets = %s, retired_secrets = %s WHERE id = %s",
        (
            [shop.secret],
            Jsonb([{"secret": shop.secret, "retired_at": "2026-01-01T00:00:00+00:00"}]),
            shop.endpoint_id,
        ),
    )
    factory.conn.execute(
        "UPDATE payhook.tenants SET signing_secret = %s WHERE id = %s", (signing, shop.tenant_id)
    )
    assert shop.secret in pg_dump(settings)
    event = StandardEvent()
    assert (
        handle(runtime, factory.standard_envelope(shop, event).to_json()).outcome
        == "unmapped_order"
    )
    factory.outbox_rows(shop, factory.order(shop))
    [claim] = claims.claim_due_rows(factory.conn, 1, 60, TEST_KEYRING)
    assert claim.signing_secret == signing

    before = run_cli(settings, "secrets", "check")
    assert before.returncode == 1
    assert len(json.loads(before.stdout)["plaintext"]) == 3

    sealed = run_cli(settings, "secrets", "seal", "--batch", "1")
    assert sealed.returncode == 0, sealed.stderr
    assert json.loads(sealed.stdout) == {
        "key": "test1",
        "resealed": 2,
        "remaining": 0,
        "failures": [],
    }
    assert run_cli(settings, "secrets", "check").returncode == 0
    dump = pg_dump(settings)
    assert shop.secret not in dump and signing not in dump
    again = StandardEvent(gateway_order_id="pi_2", merchant_reference="order-2")
    assert (
        handle(runtime, factory.standard_envelope(shop, again).to_json()).outcome
        == "unmapped_order"
    )


def test_processes_refuse_to_start_without_a_key_once_secrets_are_sealed(
    settings: Settings, factory: Factory
) -> None:
    keyless = keys_settings(settings, "")
    empty = Keyring.from_settings(keyless)
    # Nothing sealed yet: a key is not needed.
    check_key(keyless, empty)
    factory.shop()
    with pytest.raises(MissingKey, match="PAYHOOK_SECRETS_KEY"):
        check_key(keyless, empty)
    pool = create_pool(settings, "test", size=1)
    pool.open(wait=True)
    try:
        with pytest.raises(MissingKey, match="PAYHOOK_SECRETS_KEY"):
            consumer_main.check_schema(pool, empty)
    finally:
        pool.close()
    loader = PostgresEndpoints(settings.database_url, empty)

    async def load() -> None:
        try:
            await loader()
        finally:
            await loader.close()

    with pytest.raises(MissingKey, match="PAYHOOK_SECRETS_KEY"):
        asyncio.run(load())
    refused = run_cli(settings, "consumer", "--burst", PAYHOOK_SECRETS_KEY="")
    assert refused.returncode == 2
    assert "set PAYHOOK_SECRETS_KEY" in refused.stderr
    assert TEST_SECRETS_KEY.split(":")[1] not in refused.stderr + refused.stdout


def test_migrate_seals_the_plaintext_an_older_release_left(
    settings: Settings, factory: Factory
) -> None:
    shop = factory.shop()
    factory.conn.execute(
        "UPDATE payhook.webhook_endpoints SET secrets = %s WHERE id = %s",
        ([shop.secret], shop.endpoint_id),
    )
    migrated = run_cli(settings, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "sealed the secrets of 1 row(s)" in migrated.stdout
    assert all(v.startswith("sealed:v1:test1:") for v in stored_values(factory.conn))
    assert check_all(factory.conn, TEST_KEYRING).ok


def test_rotation_skips_a_row_another_transaction_holds_and_takes_it_later(
    settings: Settings, factory: Factory
) -> None:
    """No wait behind an operator's transaction: the locked row is passed
    over, the others are resealed, and a later pass takes it once released."""
    busy, free = factory.shop(), factory.shop()
    rotated = Keyring.from_settings(
        keys_settings(settings, f"{generate_key_line('k2')},{TEST_SECRETS_KEY}")
    )
    with psycopg.connect(settings.database_url) as holder:
        holder.execute("SELECT 1 FROM payhook.tenants WHERE id = %s FOR UPDATE", (busy.tenant_id,))
        with released_after(holder, 0.3) as released:
            report = reseal_all(factory.conn, rotated)
        assert released.is_set(), "the lock was held while the first pass ran"
    assert report.remaining == 0 and report.resealed == 4
    assert {key_id_of(tenant_secret(factory.conn, s)) for s in (busy, free)} == {"k2"}


def test_the_ingress_opens_an_unchanged_secret_once(
    settings: Settings, factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every full read rebuilds the copy, holding the event loop: values it
    has opened before are not opened again."""
    first, second = factory.shop(), factory.shop()
    opened: list[str] = []
    real_open = Keyring.open

    def counting(self: Keyring, value: str, aad: str) -> str:
        opened.append(aad)
        return real_open(self, value, aad)

    monkeypatch.setattr(Keyring, "open", counting)
    loader = PostgresEndpoints(settings.database_url, TEST_KEYRING, full_reload=0)

    async def load_twice() -> list[list[Endpoint] | None]:
        try:
            return [await loader(), await loader()]
        finally:
            await loader.close()

    once = asyncio.run(load_twice())
    assert len(opened) == 2
    assert [{e.id: e.secrets for e in load or []} for load in once] == [
        {first.endpoint_id: (first.secret,), second.endpoint_id: (second.secret,)}
    ] * 2
    admin.rotate_endpoint_secret(factory.conn, first.endpoint_id, keyring=TEST_KEYRING)
    opened.clear()
    asyncio.run(load_twice())
    assert opened == [endpoint_aad(first.tenant_id, first.endpoint_id)]


def test_new_key_prints_a_fresh_key_the_settings_take(settings: Settings) -> None:
    made = [run_cli(settings, "secrets", "new-key", "--id", "k7") for _ in range(2)]
    assert [m.returncode for m in made] == [0, 0], made[0].stderr
    lines = [m.stdout.strip() for m in made]
    assert lines[0] != lines[1]
    ring = Keyring.from_settings(Settings.from_env({"PAYHOOK_SECRETS_KEY": lines[0]}))
    assert ring.current == "k7"
    assert ring.open(ring.seal("whsec_x", "aad"), "aad") == "whsec_x"


def test_credentials_are_sealed_resealed_checked_and_bound_to_their_endpoint(
    settings: Settings, factory: Factory
) -> None:
    """An endpoint's API token and basic-auth password: sealed like its secret,
    resealed by a key rotation, and unopenable once copied elsewhere."""
    token, password = "live_gc_token_never_in_a_dump", "adyen-basic-auth-never-in-a-dump"
    gocardless = factory.shop("gocardless", config=Config({}, {"access_token": token}))
    adyen = factory.shop(
        "adyen", config=Config({"basic_auth_user": "ws"}, {"basic_auth_password": password})
    )
    dump = pg_dump(settings)
    assert token not in dump and password not in dump
    assert all(value.startswith("sealed:v1:test1:") for value in stored_values(factory.conn))
    assert check_all(factory.conn, TEST_KEYRING).by_key == {"test1": 6}

    rotated = keys_settings(settings, f"{generate_key_line('k2')},{TEST_SECRETS_KEY}")
    both = Keyring.from_settings(rotated)
    assert reseal_all(factory.conn, both).remaining == 0
    assert {key_id_of(v) for v in stored_values(factory.conn)} == {"k2"}
    row = factory.conn.execute(
        "SELECT credentials FROM payhook.webhook_endpoints WHERE id = %s",
        (gocardless.endpoint_id,),
    ).fetchone()
    assert row is not None
    cache = EndpointCache(both)
    endpoint, _ = cache.get(factory.conn, gocardless.endpoint_id)
    assert endpoint is not None and endpoint.credentials == {"access_token": token}

    # Copied to another endpoint, under another name: neither opens.
    factory.conn.execute(
        "UPDATE payhook.webhook_endpoints SET credentials = %s WHERE id = %s",
        (Jsonb({"basic_auth_password": row["credentials"]["access_token"]}), adyen.endpoint_id),
    )
    with capture_logs() as logs:
        endpoint, _ = cache.get(factory.conn, adyen.endpoint_id, fresh=True)
    assert endpoint is not None and endpoint.credentials == {"basic_auth_password": ""}
    assert [e["credential"] for e in logs if e["event"] == "endpoint_credential_unopenable"] == [
        "basic_auth_password"
    ]
    checked = check_all(factory.conn, both)
    assert not checked.ok
    assert checked.failures[0].startswith(f"endpoints {adyen.endpoint_id} credential")


def test_the_ingress_holds_only_the_credentials_verifying_reads(
    settings: Settings, factory: Factory
) -> None:
    """An Adyen basic-auth password, yes; a GoCardless API token, never."""
    adyen = factory.shop(
        "adyen", config=Config({"basic_auth_user": "ws"}, {"basic_auth_password": "pw"})
    )
    gocardless = factory.shop("gocardless", config=Config({}, {"access_token": "api-token"}))
    loader = PostgresEndpoints(settings.database_url, TEST_KEYRING)

    async def load() -> list[Endpoint] | None:
        try:
            return await loader()
        finally:
            await loader.close()

    loaded = {e.id: e for e in asyncio.run(load()) or []}
    assert loaded[adyen.endpoint_id].credentials == {"basic_auth_password": "pw"}
    assert loaded[gocardless.endpoint_id].credentials == {}
