"""Authentication at the ingress: other people's signers, tampering, rotation, properties.

Real PostgreSQL (endpoints) and Redis (the queue); the app runs in process.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from datetime import UTC, datetime
from typing import cast

import httpx
import pytest
import stripe as stripe_sdk
from hypothesis import given, settings
from hypothesis import strategies as st
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
from standardwebhooks.webhooks import Webhook
from starlette.applications import Starlette

from control import admin
from ingress.app import Ingress, create_app
from payhook.envelope import Envelope
from payhook.gateways import standard
from payhook.gateways import stripe as stripe_gateway
from payhook.settings import Settings
from tests.conftest import REDIS_TEST_URL, test_settings
from tests.factories import TEST_KEYRING, Factory, Shop, StandardEvent, stripe_body, stripe_headers

#: Every status an unauthenticated request may get.
REFUSALS = {400, 401, 404, 413}
#: Seconds from now of a timestamp that must be refused: past either gateway's
#: tolerance by more than a slow, loaded machine takes between signing a
#: request and the ingress checking it. The boundary itself is unit-tested.
BEYOND = max(standard.TOLERANCE, stripe_gateway.TOLERANCE) + 10


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Harness:
    def __init__(self, app: Starlette, client: httpx.AsyncClient, settings: Settings) -> None:
        self.app, self.client, self.settings = app, client, settings
        self.redis = Redis.from_url(REDIS_TEST_URL)
        #: A standard and a stripe shop, once created (hypothesis examples share them).
        self.shops: tuple[Shop, Shop] | None = None

    @property
    def ingress(self) -> Ingress:
        ingress: Ingress = self.app.state.ingress
        return ingress

    async def post(self, endpoint_id: str, body: bytes, headers: Mapping[str, str | bytes]) -> int:
        # httpx takes str and bytes values in one mapping; its annotation wants one kind.
        response = await self.client.post(f"/webhooks/{endpoint_id}", content=body, headers=headers)  # type: ignore[arg-type]
        return response.status_code

    def queued(self) -> list[bytes]:
        return cast(list[bytes], self.redis.lrange(f"rq:queue:{self.settings.queue}", 0, -1))

    def job_keys(self) -> list[bytes]:
        return list(self.redis.scan_iter("rq:job:*"))


@pytest.fixture
async def harness(database: str, redis_conn: Redis, factory: Factory) -> AsyncIterator[Harness]:
    settings = property_settings(database)
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://ingress") as client,
    ):
        harness = Harness(app, client, settings)
        yield harness
        harness.redis.close()


async def shops(harness: Harness, factory: Factory) -> tuple[Shop, Shop]:
    """A standard and a stripe shop the ingress knows."""
    if harness.shops is None:
        harness.shops = factory.shop("standard"), factory.shop("stripe")
        assert await harness.ingress.refresher.refresh()
    return harness.shops


# -- signers nobody here wrote ---------------------------------------------------------


@pytest.mark.anyio
async def test_standardwebhooks_library_signatures_are_accepted(
    harness: Harness, factory: Factory
) -> None:
    shop, _ = await shops(harness, factory)
    body = StandardEvent().body()
    msg_id, now = f"msg_{uuid.uuid4().hex}", datetime.now(UTC)
    signature = Webhook(shop.secret).sign(msg_id, now, body.decode())
    headers = {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
    }
    assert await harness.post(shop.endpoint_id, body, headers) == 202
    # Several signatures, one of them ours (a sender mid-rotation), are accepted too.
    other = Webhook(standard.generate_secret()).sign(msg_id, now, body.decode())
    headers["webhook-signature"] = f"{other} {signature}"
    assert await harness.post(shop.endpoint_id, body, headers) == 202
    assert len(harness.queued()) == 2


@pytest.mark.anyio
async def test_an_id_beyond_ascii_verifies_over_the_bytes_that_were_signed(
    harness: Harness, factory: Factory
) -> None:
    """The library signs the id's UTF-8 bytes, and a sender puts those bytes in
    the header; the check runs over the same bytes, at the ingress and again
    in the consumer, which reads the header as the ingress queued it."""
    shop, _ = await shops(harness, factory)
    body = StandardEvent().body()
    msg_id, now = f"msg_été_{uuid.uuid4().hex}", datetime.now(UTC)
    signature = Webhook(shop.secret).sign(msg_id, now, body.decode())
    headers = {
        b"webhook-id": msg_id.encode(),
        b"webhook-timestamp": str(int(now.timestamp())).encode(),
        b"webhook-signature": signature.encode(),
    }
    response = await harness.client.post(
        f"/webhooks/{shop.endpoint_id}", content=body, headers=headers
    )
    assert response.status_code == 202
    as_queued = {k.decode(): v.decode("latin-1") for k, v in headers.items()}
    standard.StandardGateway().verify(as_queued, body, [shop.secret], now=None, tolerance=None)


@pytest.mark.anyio
async def test_stripe_library_signatures_are_accepted(harness: Harness, factory: Factory) -> None:
    _, shop = await shops(harness, factory)
    body = stripe_body()
    header = stripe_sdk.WebhookSignature.generate_signature_header(body.decode(), shop.secret)
    # What Stripe's own library accepts, the ingress accepts.
    stripe_sdk.Webhook.construct_event(body, header, shop.secret)
    assert await harness.post(shop.endpoint_id, body, {"stripe-signature": header}) == 202
    [job_id] = harness.queued()
    job = harness.redis.hget(b"rq:job:" + job_id, "status")
    assert job == b"queued"


# -- tampering -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_tampered_standard_requests_are_401_and_never_queued(
    harness: Harness, factory: Factory
) -> None:
    shop, _ = await shops(harness, factory)
    event = StandardEvent()
    body = event.body()
    good = event.headers(shop.secret, body)
    now = int(time.time())
    tampered = {
        "body": (body.replace(b"1999", b"1"), good),
        "timestamp": (body, good | {"webhook-timestamp": str(event.timestamp + 1)}),
        "event id": (body, good | {"webhook-id": event.event_id + "x"}),
        "secret": (body, event.headers(standard.generate_secret(), body)),
        "stale": (body, StandardEvent(timestamp=now - BEYOND).headers(shop.secret, body)),
        "future": (
            body,
            StandardEvent(timestamp=now + BEYOND).headers(shop.secret, body),
        ),
    }
    bodies = set()
    for what, (sent, headers) in tampered.items():
        response = await harness.client.post(
            f"/webhooks/{shop.endpoint_id}", content=sent, headers=headers
        )
        assert response.status_code == 401, what
        bodies.add(response.content)
    # No response says which check failed.
    assert bodies == {b'{"error": "unauthorized"}'}
    assert harness.queued() == [] and harness.job_keys() == []
    assert await harness.post(shop.endpoint_id, body, good) == 202


@pytest.mark.anyio
async def test_tampered_stripe_requests_are_401_and_never_queued(
    harness: Harness, factory: Factory
) -> None:
    _, shop = await shops(harness, factory)
    body = stripe_body()
    now = int(time.time())
    good = stripe_headers(shop.secret, body, now)
    tampered = [
        (body.replace(b"1999", b"1"), good),
        (body, {"stripe-signature": good["stripe-signature"].replace(f"t={now}", f"t={now + 1}")}),
        (body, stripe_headers(stripe_gateway.generate_secret(), body, now)),
        (body, stripe_headers(shop.secret, body, now - BEYOND)),
    ]
    for sent, headers in tampered:
        assert await harness.post(shop.endpoint_id, sent, headers) == 401
    assert harness.queued() == [] and harness.job_keys() == []
    assert await harness.post(shop.endpoint_id, body, good) == 202


@pytest.mark.anyio
async def test_rotation_accepts_both_secrets_until_the_old_one_is_retired(
    harness: Harness, factory: Factory, conn: object
) -> None:
    shop, _ = await shops(harness, factory)
    old = shop.secret
    new = admin.rotate_endpoint_secret(factory.conn, shop.endpoint_id, keyring=TEST_KEYRING)
    assert await harness.ingress.refresher.refresh()
    for secret in (old, new):
        event = StandardEvent()
        assert await harness.post(shop.endpoint_id, event.body(), event.headers(secret)) == 202

    admin.retire_old_secrets(factory.conn, shop.endpoint_id)
    assert await harness.ingress.refresher.refresh()
    retired, current = StandardEvent(), StandardEvent()
    assert await harness.post(shop.endpoint_id, retired.body(), retired.headers(old)) == 401
    assert await harness.post(shop.endpoint_id, current.body(), current.headers(new)) == 202
    assert len(harness.queued()) == 3


# -- properties ------------------------------------------------------------------------

printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)
#: Endpoint ids that are not ids, as one path segment.
path_segments = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/?#%."),
    min_size=1,
    max_size=60,
)
bodies = st.one_of(
    st.binary(max_size=600),
    st.builds(lambda e: e.body(), st.builds(StandardEvent, amount=st.integers(0, 10**9))),
    st.just(b"x" * 5000),  # over PAYHOOK_MAX_BODY
)
header_names = st.sampled_from(
    ["webhook-id", "webhook-timestamp", "webhook-signature", "stripe-signature", "x-other"]
)


#: Bytes a header value can carry over HTTP/1.1: anything but CR, LF and NUL.
header_bytes = st.binary(min_size=1, max_size=44).filter(
    lambda value: not any(c in value for c in b"\r\n\x00")
)


def near_miss_headers(data: st.DataObject, shop: Shop, body: bytes) -> dict[str, str | bytes]:
    """Headers one step from authentic: right shape, something wrong."""
    now = int(time.time())
    mistake = data.draw(
        st.sampled_from(["secret", "body", "timestamp", "garbage", "scheme", "bytes"])
    )
    secret = shop.secret
    signed_body = body
    timestamp = now
    if mistake == "secret":
        secret = standard.generate_secret() if shop.gateway == "standard" else "whsec_x"
    elif mistake == "body":
        signed_body = body + b" "
    elif mistake == "timestamp":
        timestamp = now + data.draw(st.sampled_from([-1000, -BEYOND, BEYOND, 10**6]))
    if shop.gateway == "standard":
        event_id = data.draw(printable.filter(bool))
        signature = standard.sign(secret, event_id, timestamp, signed_body)
        if mistake == "garbage":
            raw = data.draw(st.binary(min_size=32, max_size=32))
            signature = "v1," + base64.b64encode(raw).decode()
        elif mistake == "scheme":
            signature = signature.replace("v1,", "v1a,")
        return {
            "webhook-id": event_id,
            "webhook-timestamp": str(timestamp),
            # Header values are bytes: any of them, not only base64, after the scheme.
            "webhook-signature": b"v1," + data.draw(header_bytes)
            if mistake == "bytes"
            else signature,
        }
    header = stripe_gateway.sign(secret, timestamp, signed_body)
    if mistake == "garbage":
        header = f"t={timestamp},v1={data.draw(st.binary(min_size=32, max_size=32)).hex()}"
    elif mistake == "scheme":
        header = header.replace("v1=", "v0=")
    elif mistake == "bytes":
        return {"stripe-signature": b"t=%d,v1=" % timestamp + data.draw(header_bytes)}
    return {"stripe-signature": header}


@contextmanager
def serving(settings: Settings, factory: Factory) -> Iterator[tuple[asyncio.Runner, Harness]]:
    """The app and a client on an event loop of the test's own, for hypothesis' sync tests."""
    with asyncio.Runner() as runner:
        stack = AsyncExitStack()
        app = create_app(settings)
        transport = httpx.ASGITransport(app=app)
        runner.run(stack.enter_async_context(app.router.lifespan_context(app)))
        client = runner.run(
            stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url="http://ingress")
            )
        )
        harness = Harness(app, client, settings)
        runner.run(shops(harness, factory))
        try:
            yield runner, harness
        finally:
            runner.run(stack.aclose())
            harness.redis.close()


def test_no_unauthenticated_request_is_ever_queued_or_a_5xx(
    database: str, redis_conn: Redis, factory: Factory
) -> None:
    """Random and near-miss headers, bodies and ids: refused, and the queue stays empty."""
    with serving(property_settings(database), factory) as (runner, harness):
        assert harness.shops is not None
        known = harness.shops

        # Examples share the app and Redis on purpose: nothing may accumulate.
        @settings(max_examples=150, deadline=None)
        @given(data=st.data())
        def check(data: st.DataObject) -> None:
            shop = data.draw(st.sampled_from(known))
            endpoint_id = data.draw(
                st.one_of(st.just(shop.endpoint_id), st.uuids().map(str), path_segments)
            )
            body = data.draw(bodies)
            if data.draw(st.booleans()):
                headers = near_miss_headers(data, shop, body)
            else:
                headers = data.draw(st.dictionaries(header_names, printable, max_size=4))

            status = runner.run(harness.post(endpoint_id, body, headers))

            assert status in REFUSALS
            assert harness.queued() == [] and harness.job_keys() == []

        check()


def test_every_authentic_body_is_queued_byte_for_byte(
    database: str, redis_conn: Redis, factory: Factory
) -> None:
    """Whatever the bytes, if the signature is right the exact body is queued, once."""
    with serving(property_settings(database), factory) as (runner, harness):
        assert harness.shops is not None
        standard_shop, stripe_shop = harness.shops

        @settings(max_examples=100, deadline=None)
        @given(body=st.binary(max_size=4096), gateway=st.sampled_from(["standard", "stripe"]))
        def check(body: bytes, gateway: str) -> None:
            if gateway == "standard":
                shop, headers = standard_shop, StandardEvent().headers(standard_shop.secret, body)
            else:
                shop, headers = stripe_shop, stripe_headers(stripe_shop.secret, body)
            before = len(harness.queued())
            response = runner.run(
                harness.client.post(f"/webhooks/{shop.endpoint_id}", content=body, headers=headers)
            )
            assert response.status_code == 202
            queued = harness.queued()
            assert len(queued) == before + 1
            job = Job.fetch(queued[-1].decode(), harness.redis, serializer=JSONSerializer)
            assert job.id == response.json()["delivery_id"]
            assert Envelope.from_json(job.args[0]).body == body

        check()


def property_settings(database: str) -> Settings:
    return test_settings(database, PAYHOOK_ENDPOINT_REFRESH="1h", PAYHOOK_MAX_BODY="4096")
