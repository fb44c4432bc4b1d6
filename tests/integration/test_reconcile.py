"""`payhook reconcile` against a local fake of Stripe's events API, with real
PostgreSQL and Redis: what never arrived is queued once, through the
consumer's path, and arrives later as a duplicate."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from consumer.handler import Runtime, handle
from control import reconcile
from control.cli import build_parser
from control.sender import Event as SendEvent
from control.sender import sign_event
from payhook.errors import PayhookError
from payhook.gateways import stripe as stripe_gateway
from payhook.gateways.base import Config
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, Factory, Shop
from tests.gateway_api import FakeStripeEvents
from tests.harness import Harness, drain, refresh
from tests.processes import process_env, start, stop, wait_until

pytestmark = pytest.mark.anyio
KEY = "rk_test_reconcile"
NOW = int(time.time())


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def stripe_api() -> Iterator[FakeStripeEvents]:
    api = FakeStripeEvents(KEY)
    with api.running():
        yield api


@pytest.fixture
def shop(factory: Factory, stripe_api: FakeStripeEvents) -> Shop:
    config = Config({"api_base_url": stripe_api.url}, {"api_key": KEY})
    return factory.shop("stripe", config=config)


def stripe_event(
    shop: Shop, n: int, event_type: str = "payment_intent.succeeded"
) -> dict[str, Any]:
    """An event as Stripe's API lists it (and its webhook carries it)."""
    event = SendEvent(
        "stripe",
        event_type,
        f"pi_rec_{n}",
        1999,
        "EUR",
        f"order-{n}",
        f"evt_rec_{n:04d}",
        NOW - 3600 + n,
    )
    body: dict[str, Any] = json.loads(sign_event(event, shop.secret, NOW).body)
    return body


def taken(redis: Redis, settings: Settings) -> list[dict[str, Any]]:
    """The envelopes of the queued jobs, oldest first, taken off the queue."""
    key = f"rq:queue:{settings.queue}"
    ids = [i.decode() for i in cast(list[bytes], redis.lrange(key, 0, -1))]
    redis.delete(key)
    return [Job.fetch(i, redis, serializer=JSONSerializer).args[0] for i in ids]


def run(
    factory: Factory, redis: Redis, settings: Settings, shop: Shop, **options: Any
) -> reconcile.Run:
    waits: list[float] = options.pop("waits", [])
    return reconcile.reconcile(
        factory.conn,
        redis,
        settings,
        shop.endpoint_id,
        timedelta(hours=72),
        keyring=TEST_KEYRING,
        sleep=waits.append,
        **options,
    )


async def test_events_that_never_arrived_are_queued_once_and_a_late_webhook_is_a_duplicate(
    harness: Harness,
    factory: Factory,
    shop: Shop,
    stripe_api: FakeStripeEvents,
    ingress_settings: Settings,
    redis_conn: Redis,
) -> None:
    await refresh(harness)
    orders = [factory.order(shop, f"order-{n}", f"pi_rec_{n}") for n in range(5)]
    events = [stripe_event(shop, n) for n in range(5)]
    stripe_api.events = [*events, stripe_event(shop, 99, "customer.created")]
    # Two of them were delivered as webhooks.
    for n in (0, 1):
        request = sign_event(
            SendEvent(
                "stripe",
                "payment_intent.succeeded",
                f"pi_rec_{n}",
                1999,
                "EUR",
                f"order-{n}",
                f"evt_rec_{n:04d}",
                NOW - 3600 + n,
            ),
            shop.secret,
            int(time.time()),
        )
        assert (
            await harness.post(shop.endpoint_id, request.body, request.headers)
        ).status_code == 202
    assert [r["outcome"] for r in drain(ingress_settings)] == ["applied", "applied"]

    dry = run(factory, redis_conn, ingress_settings, shop, dry_run=True)
    assert (dry.listed, dry.missing, dry.queued, dry.error) == (6, 3, 0, None)
    assert harness.jobs() == []
    done = run(factory, redis_conn, ingress_settings, shop)
    assert (done.listed, done.missing, done.queued, done.error) == (6, 3, 3, None)
    assert sorted(r["outcome"] for r in drain(ingress_settings)) == ["applied"] * 3
    assert {factory.order_state(shop, o) for o in orders} == {"paid"}

    # Stripe's webhook of a reconciled event arrives at last: a duplicate.
    late = sign_event(
        SendEvent(
            "stripe",
            "payment_intent.succeeded",
            "pi_rec_4",
            1999,
            "EUR",
            "order-4",
            "evt_rec_0004",
            NOW - 3600 + 4,
        ),
        shop.secret,
        int(time.time()),
    )
    assert (await harness.post(shop.endpoint_id, late.body, late.headers)).status_code == 202
    assert [r["outcome"] for r in drain(ingress_settings)] == ["duplicate"]
    assert factory.count("security_anomalies", tenant_id=shop.tenant_id) == 0
    again = run(factory, redis_conn, ingress_settings, shop)
    assert (again.missing, again.queued) == (0, 0)


def test_pages_429s_and_a_failure_mid_run_resume_where_it_stopped(
    factory: Factory,
    shop: Shop,
    stripe_api: FakeStripeEvents,
    settings: Settings,
    redis_conn: Redis,
    runtime: Runtime,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stripe_gateway, "PAGE", 2)
    stripe_api.events = [stripe_event(shop, n) for n in range(7)]
    # A 429 first, waited out as it asks.
    stripe_api.fail_next = [(429, "3")]
    waits: list[float] = []
    first = run(factory, redis_conn, settings, shop, waits=waits)
    assert first.error is None and first.queued == 7 and waits == [3.0]
    assert [handle(runtime, data).outcome for data in taken(redis_conn, settings)] == [
        "unmapped_order"  # no orders here: recorded, each once
    ] * 7

    # Another window of events, and the API failing mid-run.
    stripe_api.events += [stripe_event(shop, n) for n in range(10, 15)]
    stripe_api.queries.clear()
    original = stripe_api.answer
    calls = {"n": 0}

    def flaky(path: str, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        calls["n"] += 1
        if 2 <= calls["n"] <= 4:  # the second page, three times: the run gives up
            return 500, b'{"error": {"type": "api_error"}}', {}
        return original(path, headers)

    monkeypatch.setattr(stripe_api, "answer", flaky)
    stopped = run(factory, redis_conn, settings, shop, waits=waits)
    assert stopped.error is not None and "500" in stopped.error
    assert stopped.queued == 2 and stopped.cursor is not None
    resumed = run(factory, redis_conn, settings, shop, waits=waits)
    assert resumed.error is None and resumed.window_start == stopped.window_start
    assert stripe_api.queries[1].get("starting_after") == stopped.cursor
    # The new events, each queued once over the two runs; the old ones had receipts.
    assert stopped.queued + resumed.queued == 5
    outcomes = [handle(runtime, data).outcome for data in taken(redis_conn, settings)]
    assert outcomes == ["unmapped_order"] * 5
    assert factory.count("payment_event_receipts", tenant_id=shop.tenant_id) == 12


def test_a_forged_reconciled_job_is_an_anomaly(
    factory: Factory,
    shop: Shop,
    stripe_api: FakeStripeEvents,
    settings: Settings,
    redis_conn: Redis,
    runtime: Runtime,
) -> None:
    stripe_api.events = [stripe_event(shop, 1)]
    assert run(factory, redis_conn, settings, shop).queued == 1
    (data,) = taken(redis_conn, settings)
    forged = data | {"body": data["body"].replace("1999", "1")}
    assert handle(runtime, forged).outcome == "signature_invalid"
    assert handle(runtime, data).outcome == "unmapped_order"


def test_the_command_line_runs_and_lists_runs(
    factory: Factory,
    shop: Shop,
    stripe_api: FakeStripeEvents,
    settings: Settings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stripe_api.events = [stripe_event(shop, 1)]
    args = build_parser().parse_args(
        ["reconcile", "--endpoint", shop.endpoint_id, "--since", "24h", "--dry-run"]
    )
    assert args.func(args, settings) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (printed["missing"], printed["queued"], printed["dry_run"]) == (1, 0, True)
    args = build_parser().parse_args(["reconcile", "--endpoint", shop.endpoint_id, "--runs"])
    assert args.func(args, settings) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["id"] == printed["id"]
    other = factory.shop("standard")
    args = build_parser().parse_args(["reconcile", "--endpoint", other.endpoint_id])
    with pytest.raises(PayhookError, match="lists no events"):
        args.func(args, settings)


def test_all_endpoints_with_an_api_key_on_a_schedule(
    factory: Factory,
    shop: Shop,
    stripe_api: FakeStripeEvents,
    settings: Settings,
    tmp_path: Path,
) -> None:
    """`payhook reconcile --scheduled` runs every PAYHOOK_RECONCILE_EVERY for
    every endpoint that has an API key, until SIGTERM."""
    keyless = factory.shop("stripe")
    stripe_api.events = [stripe_event(shop, 1)]
    assert reconcile.reconcilable(factory.conn) == [shop.endpoint_id]
    assert keyless.endpoint_id not in reconcile.reconcilable(factory.conn)
    env = process_env(settings, PAYHOOK_RECONCILE_EVERY="1s")
    proc = start(["reconcile", "--scheduled", "--since", "24h"], env, tmp_path / "reconcile.log")
    try:
        wait_until(
            lambda: factory.count("reconcile_runs", tenant_id=shop.tenant_id) >= 2,
            30,
            "two scheduled runs",
        )
    finally:
        code = stop(proc, signal.SIGTERM)
    assert code == 0, (tmp_path / "reconcile.log").read_text()
    (first, *_) = factory.conn.execute(
        "SELECT missing, queued, error FROM payhook.reconcile_runs WHERE tenant_id = %s"
        " ORDER BY started_at",
        (shop.tenant_id,),
    ).fetchall()
    assert first == {"missing": 1, "queued": 1, "error": None}
