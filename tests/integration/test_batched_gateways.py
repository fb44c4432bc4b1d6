"""Batched gateways through the real ingress, queue and consumer: one job,
receipt and outcome per event; the request acknowledged as the gateway
expects, or refused whole."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from consumer.endpoints import EndpointCache
from consumer.handler import Runtime, handle
from control.cli import build_parser
from control.sender import Event as SendEvent
from control.sender import sign_event
from ingress.routes import MAX_EVENTS
from payhook.envelope import Envelope, Part
from payhook.errors import PayhookError
from payhook.gateways import gocardless
from payhook.gateways.base import Config
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, Factory, Shop
from tests.gateway_api import FakeApi
from tests.harness import Harness, drain, refresh, running

pytestmark = pytest.mark.anyio
TOKEN = "live_read_only"
NOW = int(datetime.now(UTC).timestamp())


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi(TOKEN)
    with fake.running():
        yield fake


def gocardless_shop(factory: Factory, api: FakeApi) -> Shop:
    return factory.shop(
        "gocardless", config=Config({"api_base_url": api.url}, {"access_token": TOKEN})
    )


def payment(api: FakeApi, payment_id: str, amount: int, reference: str | None = None) -> None:
    metadata = {"order_id": reference} if reference else {}
    api.add(
        "payments",
        {
            "id": payment_id,
            "amount": amount,
            "currency": "GBP",
            "status": "confirmed",
            "metadata": metadata,
        },
    )


def send(
    shop: Shop,
    order: str,
    *types: str,
    amount: int = 2500,
    event_id: str | None = None,
    secret: str | None = None,
    config: Config | None = None,
) -> tuple[bytes, dict[str, str]]:
    event = SendEvent(shop.gateway, types[0], order, amount, "GBP", None, event_id, NOW, types[1:])
    request = sign_event(event, secret or shop.secret, config=config or Config())
    return request.body, request.headers


def jobs(harness: Harness) -> list[Job]:
    return harness.jobs()


def receipts(factory: Factory, shop: Shop) -> list[dict[str, Any]]:
    return factory.conn.execute(
        "SELECT event_id, event_type, outcome FROM payhook.payment_event_receipts"
        " WHERE tenant_id = %s ORDER BY event_id",
        (shop.tenant_id,),
    ).fetchall()


async def test_a_gocardless_webhook_is_one_job_and_one_receipt_per_event(
    harness: Harness, factory: Factory, api: FakeApi, ingress_settings: Settings
) -> None:
    shop = gocardless_shop(factory, api)
    await refresh(harness)
    paid = factory.order(shop, "order-g1", "PM001", 2500, "GBP")
    failed = factory.order(shop, "order-g2", "PM002", 900, "GBP")
    payment(api, "PM001", 2500)
    payment(api, "PM002", 900)
    body, headers = send(shop, "PM001", "payments.confirmed", "payments.paid_out")
    extra = json.loads(body)
    failure = dict(extra["events"][0], id="EV_F1", action="failed", links={"payment": "PM002"})
    extra["events"].append(failure)
    body = json.dumps(extra).encode()
    headers = {"webhook-signature": gocardless.sign(shop.secret, body)}

    response = await harness.post(shop.endpoint_id, body, headers)
    assert response.status_code == 204 and response.content == b""
    queued = jobs(harness)
    assert len(queued) == 3
    parts = [Envelope.from_json(job.args[0]).part for job in queued]
    assert all(isinstance(p, Part) for p in parts)
    assert sorted(cast(Part, p).index for p in parts) == [0, 1, 2]
    assert len({cast(Part, p).request_id for p in parts}) == 1

    results = drain(ingress_settings)
    assert sorted(r["outcome"] for r in results) == ["already_applied", "applied", "applied"]
    assert factory.order_state(shop, paid) == "paid"
    assert factory.order_state(shop, failed) == "failed"
    assert len(receipts(factory, shop)) == 3
    assert [path for _, path, _ in api.requests].count("/payments/PM001") == 2

    # GoCardless resends the webhook: three duplicates, nothing applied twice.
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 204
    assert [r["outcome"] for r in drain(ingress_settings)] == ["duplicate"] * 3
    assert factory.count("payment_outbox", tenant_id=shop.tenant_id) == 2


async def test_a_gocardless_webhook_not_authentic_is_refused_whole_with_498(
    harness: Harness, factory: Factory, api: FakeApi
) -> None:
    shop = gocardless_shop(factory, api)
    await refresh(harness)
    body, _ = send(shop, "PM001", "payments.confirmed", "refunds.refund_settled")
    response = await harness.post(shop.endpoint_id, body, {"webhook-signature": "0" * 64})
    assert response.status_code == 498
    assert jobs(harness) == []


async def test_a_request_of_more_events_than_any_gateway_sends_is_refused_whole(
    harness: Harness, factory: Factory, api: FakeApi
) -> None:
    shop = gocardless_shop(factory, api)
    await refresh(harness)
    events = [{"id": f"EV{i}"} for i in range(MAX_EVENTS + 1)]
    body = json.dumps({"events": events}).encode()
    signature = {"webhook-signature": gocardless.sign(shop.secret, body)}
    response = await harness.post(shop.endpoint_id, body, signature)
    assert (response.status_code, response.json()) == (413, {"error": "too_many_events"})
    assert jobs(harness) == []
    body = json.dumps({"events": events[:MAX_EVENTS]}).encode()
    signature = {"webhook-signature": gocardless.sign(shop.secret, body)}
    assert (await harness.post(shop.endpoint_id, body, signature)).status_code == 204
    assert len(jobs(harness)) == MAX_EVENTS


async def test_an_event_whose_api_fails_waits_in_the_dead_letter_queue_alone(
    factory: Factory, api: FakeApi, ingress_settings: Settings
) -> None:
    settings = dataclasses.replace(ingress_settings, job_retry_intervals=(0,))
    shop = gocardless_shop(factory, api)
    paid = factory.order(shop, "order-g1", "PM001", 2500, "GBP")
    later = factory.order(shop, "order-g3", "PM003", 700, "GBP")
    payment(api, "PM001", 2500)  # PM003: not known to the API yet (404)
    body, _ = send(shop, "PM001", "payments.confirmed")
    both = json.loads(body)
    both["events"].append(dict(both["events"][0], id="EV_X", links={"payment": "PM003"}))
    body = json.dumps(both).encode()
    async with running(settings) as harness:
        await refresh(harness)
        response = await harness.post(
            shop.endpoint_id, body, {"webhook-signature": gocardless.sign(shop.secret, body)}
        )
        assert response.status_code == 204
        drain(settings)
        assert factory.order_state(shop, paid) == "paid"
        assert factory.order_state(shop, later) == "pending"
        failed = FailedJobRegistry(settings.queue, connection=harness.redis)
        (dead,) = failed.get_job_ids()
        job = Job.fetch(dead, harness.redis, serializer=JSONSerializer)
        assert (
            Envelope.from_json(job.args[0]).body
            == json.dumps(both["events"][1], separators=(",", ":")).encode()
        )
        latest = job.latest_result()
        assert latest is not None and "GatewayUnavailable" in (latest.exc_string or "")
        # Its receipt is not written: it never began.
        assert factory.count("payment_event_receipts", tenant_id=shop.tenant_id) == 1
        # The API knows the payment now; the operator requeues the dead letter.
        payment(api, "PM003", 700)
        failed.requeue(dead)
        assert [r["outcome"] for r in drain(settings)] == ["applied"]
    assert factory.order_state(shop, later) == "paid"


async def test_an_amount_the_api_gives_is_checked_like_any_other(
    harness: Harness, factory: Factory, api: FakeApi, ingress_settings: Settings
) -> None:
    shop = gocardless_shop(factory, api)
    await refresh(harness)
    order = factory.order(shop, "order-g1", "PM001", 2500, "GBP")
    payment(api, "PM001", 25)
    body, headers = send(shop, "PM001", "payments.confirmed")
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 204
    assert [r["outcome"] for r in drain(ingress_settings)] == ["amount_mismatch"]
    assert factory.order_state(shop, order) == "pending"


async def test_an_adyen_notification_is_one_job_per_item_answered_accepted(
    harness: Harness, factory: Factory, ingress_settings: Settings
) -> None:
    shop = factory.shop("adyen")
    await refresh(harness)
    order = factory.order(shop, "order-a1", "8835511210681752", 2500, "GBP")
    body, headers = send(shop, "8835511210681752", "AUTHORISATION", "REFUND")
    response = await harness.post(shop.endpoint_id, body, headers)
    assert (response.status_code, response.content) == (200, b"[accepted]")
    assert response.headers["content-type"] == "text/plain"
    assert sorted(r["outcome"] for r in drain(ingress_settings)) == ["applied", "applied"]
    assert factory.order_state(shop, order) == "refunded"
    ids = [r["event_id"] for r in receipts(factory, shop)]
    assert ids[0] == "AUTHORISATION:8835511210681752:true" and ids[1].startswith("REFUND:")
    # Adyen retries the notification: duplicates.
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 200
    assert [r["outcome"] for r in drain(ingress_settings)] == ["duplicate", "duplicate"]


async def test_an_adyen_notification_with_one_forged_item_is_refused_whole(
    harness: Harness, factory: Factory
) -> None:
    shop = factory.shop("adyen")
    await refresh(harness)
    body, headers = send(shop, "8835511210681752", "AUTHORISATION", "REFUND")
    forged = json.loads(body)
    forged["notificationItems"][1]["NotificationRequestItem"]["amount"]["value"] = 1
    response = await harness.post(shop.endpoint_id, json.dumps(forged).encode(), headers)
    assert response.status_code == 401
    assert jobs(harness) == []


async def test_a_part_is_verified_by_its_proof_and_a_forged_one_is_an_anomaly(
    harness: Harness, factory: Factory, runtime: Runtime
) -> None:
    shop = factory.shop("adyen")
    other = factory.shop("adyen")
    await refresh(harness)
    order = factory.order(shop, "order-a1", "8835511210681752", 2500, "GBP")
    body, headers = send(shop, "8835511210681752", "AUTHORISATION")
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 200
    (job,) = jobs(harness)
    real = job.args[0]
    forged = [
        # Another amount under the proof of the real item.
        real | {"body": real["body"].replace("2500", "25")},
        # The real item, proven for another endpoint.
        real | {"endpoint_id": other.endpoint_id},
        # Another index than the one proven.
        real | {"part": real["part"] | {"index": 1, "count": 2}},
        # A proof made with no secret payhook holds.
        real | {"part": real["part"] | {"proof": "0" * 64}},
    ]
    for data in forged:
        assert handle(runtime, data).outcome == "signature_invalid"
    assert factory.count("security_anomalies", kind="signature_invalid") == 4
    assert factory.order_state(shop, order) == "pending"
    assert handle(runtime, real).outcome == "applied"


async def test_endpoints_add_and_send_take_each_gateways_settings(
    harness: Harness,
    factory: Factory,
    api: FakeApi,
    settings: Settings,
    ingress_settings: Settings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tenant = factory.shop().tenant_id
    add = ["endpoints", "add", "--tenant", tenant, "--gateway", "gocardless"]
    args = build_parser().parse_args(add)
    with pytest.raises(PayhookError, match="access_token is required"):
        args.func(args, settings)
    args = build_parser().parse_args(
        [*add, "--setting", f"api_base_url={api.url}", "--credential", f"access_token={TOKEN}"]
    )
    assert args.func(args, settings) == 0
    endpoint = json.loads(capsys.readouterr().out)
    stored = factory.conn.execute(
        "SELECT settings, credentials FROM payhook.webhook_endpoints WHERE id = %s",
        (endpoint["endpoint_id"],),
    ).fetchone()
    assert stored is not None and stored["settings"] == {"api_base_url": api.url}
    assert stored["credentials"]["access_token"].startswith("sealed:")
    factory.order(
        Shop(tenant, endpoint["endpoint_id"], endpoint["secret"], "gocardless"),
        "order-s1",
        "PM777",
        1200,
        "GBP",
    )
    payment(api, "PM777", 1200)
    await refresh(harness)
    shop = Shop(tenant, endpoint["endpoint_id"], endpoint["secret"], "gocardless")
    body, headers = send(shop, "PM777", "payments.confirmed", "payments.paid_out")
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 204
    assert sorted(r["outcome"] for r in drain(ingress_settings)) == ["already_applied", "applied"]


def test_endpoints_configure_rotates_a_credential_and_keeps_the_rest(
    factory: Factory, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    shop = factory.shop(
        "gocardless",
        config=Config(
            {"api_base_url": "https://api-sandbox.gocardless.com"}, {"access_token": "a"}
        ),
    )
    before = factory.conn.execute(
        "SELECT credentials FROM payhook.webhook_endpoints WHERE id = %s", (shop.endpoint_id,)
    ).fetchone()
    argv = ["endpoints", "configure", shop.endpoint_id, "--credential", "access_token=b"]
    args = build_parser().parse_args(argv)
    assert args.func(args, settings) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {
        "endpoint_id": shop.endpoint_id,
        "settings": {"api_base_url": "https://api-sandbox.gocardless.com"},
        "credentials": ["access_token"],
    }
    cache = EndpointCache(TEST_KEYRING)
    endpoint, _ = cache.get(factory.conn, shop.endpoint_id)
    assert endpoint is not None and endpoint.credentials == {"access_token": "b"}
    after = factory.conn.execute(
        "SELECT credentials FROM payhook.webhook_endpoints WHERE id = %s", (shop.endpoint_id,)
    ).fetchone()
    assert before is not None and after is not None
    assert after["credentials"]["access_token"] != before["credentials"]["access_token"]
    assert after["credentials"]["access_token"].startswith("sealed:")
    # What the gateway requires cannot be removed; an unknown name is refused.
    for bad, message in (
        (["--unset", "access_token"], "access_token is required"),
        (["--unset", "webhook_url"], "no setting 'webhook_url'"),
        (["--setting", "api_base_url=http://api.gocardless.com"], "https"),
    ):
        args = build_parser().parse_args(["endpoints", "configure", shop.endpoint_id, *bad])
        with pytest.raises(PayhookError, match=message):
            args.func(args, settings)
    args = build_parser().parse_args(
        ["endpoints", "configure", shop.endpoint_id, "--unset", "api_base_url"]
    )
    assert args.func(args, settings) == 0
    assert json.loads(capsys.readouterr().out)["settings"] == {}
