"""The ingress's HTTP contract against real PostgreSQL and Redis, app in process.

Jobs the ingress writes are run by the consumer's real RQ worker, so "queued"
here means "a worker applies it".
"""

from __future__ import annotations

import asyncio
import json
import uuid
import zlib
from collections.abc import AsyncIterable
from typing import Any, cast

import httpx
import psycopg
import pytest
from redis import Redis
from structlog.testing import capture_logs

from control import admin
from ingress.endpoints import PostgresEndpoints
from payhook.endpoints import Endpoint
from payhook.envelope import Envelope
from payhook.errors import PayhookError
from payhook.queue import APPLY_EVENT, enqueue_event, events_queue
from payhook.settings import Settings
from tests.conftest import test_settings
from tests.factories import TEST_KEYRING, Factory, Shop, StandardEvent, stripe_body, stripe_headers
from tests.harness import Harness, drain, refresh, running, spare_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def signed_event(harness: Harness, factory: Factory) -> tuple[Shop, bytes, dict[str, str]]:
    """A shop whose endpoint the ingress knows, and a payment event's body and
    headers signed for it."""
    shop = factory.shop()
    await refresh(harness)
    event = StandardEvent()
    body = event.body()
    return shop, body, event.headers(shop.secret, body)


# -- accepted events -----------------------------------------------------------------


async def test_accepted_event_is_queued_as_the_consumers_envelope_and_applied(
    harness: Harness, factory: Factory
) -> None:
    shop = factory.shop()
    order_id = factory.order(shop)
    await refresh(harness)
    event = StandardEvent()
    body = event.body()
    headers = event.headers(shop.secret, body) | {"x-forwarded-for": "203.0.113.9"}

    response = await harness.post(shop.endpoint_id, body, headers)

    assert response.status_code == 202
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["content-length"]) == len(response.content)
    delivery_id = response.json()["delivery_id"]
    [job] = harness.jobs()
    assert job.id == delivery_id and job.func_name == APPLY_EVENT
    assert job.retries_left == len(harness.settings.job_retry_intervals)
    envelope = Envelope.from_json(job.args[0])
    assert envelope.body == body
    assert envelope.endpoint_id == shop.endpoint_id and envelope.delivery_id == delivery_id
    # Only the signature headers travel, lower-case, so the consumer can re-verify.
    assert dict(envelope.headers) == {k: v for k, v in headers.items() if k.startswith("webhook-")}

    assert drain(harness.settings) == [{"outcome": "applied", "order_id": order_id, "retries": 0}]
    assert factory.order_state(shop, order_id) == "paid"


async def test_stripe_event_is_queued_and_applied(harness: Harness, factory: Factory) -> None:
    shop = factory.shop("stripe")
    order_id = factory.order(shop)
    await refresh(harness)
    body = stripe_body()

    response = await harness.post(shop.endpoint_id, body, stripe_headers(shop.secret, body))

    assert response.status_code == 202
    [result] = drain(harness.settings)
    assert result["outcome"] == "applied"
    assert factory.order_state(shop, order_id) == "paid"


async def test_job_in_redis_is_the_one_enqueue_event_writes(
    harness: Harness, factory: Factory
) -> None:
    """Field by field, against RQ's own enqueue of the same envelope."""
    shop, body, headers = await signed_event(harness, factory)
    response = await harness.post(shop.endpoint_id, body, headers)
    [ours] = harness.jobs()
    theirs = Envelope.from_json(ours.args[0])
    twin = Envelope(
        theirs.endpoint_id, theirs.body, theirs.headers, theirs.received_at, str(uuid.uuid4())
    )
    enqueue_event(events_queue(harness.redis, harness.settings), twin, harness.settings)

    ingress_hash = cast(
        dict[bytes, bytes], harness.redis.hgetall(f"rq:job:{response.json()['delivery_id']}")
    )
    rq_hash = cast(dict[bytes, bytes], harness.redis.hgetall(f"rq:job:{twin.delivery_id}"))
    assert set(ingress_hash) == set(rq_hash)
    differing = {k for k in rq_hash if rq_hash[k] != ingress_hash[k]}
    assert differing <= {b"created_at", b"enqueued_at", b"description", b"data"}
    ingress_call = json.loads(zlib.decompress(ingress_hash[b"data"]))
    rq_call = json.loads(zlib.decompress(rq_hash[b"data"]))
    rq_call[2][0]["delivery_id"] = theirs.delivery_id
    assert ingress_call == rq_call
    assert harness.redis.ttl(f"rq:job:{twin.delivery_id}") == harness.redis.ttl(
        f"rq:job:{theirs.delivery_id}"
    )
    assert harness.redis.smembers("rq:queues") == {f"rq:queue:{harness.settings.queue}".encode()}


# -- refused requests ----------------------------------------------------------------


async def test_unknown_endpoints_are_404_and_never_reach_postgresql(
    ingress_settings: Settings, factory: Factory
) -> None:
    """Random ids cost no query: the table is read once per interval, whatever is asked."""
    reader = PostgresEndpoints(ingress_settings.database_url, TEST_KEYRING)
    loads = 0

    async def counting() -> list[Endpoint] | None:
        nonlocal loads
        loads += 1
        return await reader()

    factory.shop()
    async with running(ingress_settings, load_endpoints=counting) as harness:
        for _ in range(200):
            response = await harness.post(str(uuid.uuid4()), b"{}", {})
            assert response.status_code == 404
            assert response.json() == {"error": "not_found"}
        for junk in ("not-a-uuid", "1" * 300):
            assert (await harness.post(junk, b"{}", {})).status_code == 404
    await reader.close()
    assert loads == 1


async def test_the_endpoint_table_is_read_again_only_when_it_changed(
    ingress_settings: Settings, factory: Factory
) -> None:
    """Each refresh reads one counter; the whole table (rebuilt on the event
    loop, so large tables stall requests) only after a change of any kind,
    or once the full-reload interval has passed."""
    shop = factory.shop()
    reader = PostgresEndpoints(ingress_settings.database_url, TEST_KEYRING)
    try:
        first = await reader()
        assert first is not None and [e.id for e in first] == [shop.endpoint_id]
        assert await reader() is None, "unchanged: nothing read"

        other = factory.shop()
        added = await reader()
        assert added is not None
        assert {e.id for e in added} == {shop.endpoint_id, other.endpoint_id}
        assert await reader() is None

        with factory.conn.transaction():
            factory.conn.execute(
                "UPDATE payhook.webhook_endpoints SET secrets = %s WHERE id = %s",
                (["whsec_bmV3", shop.secret], shop.endpoint_id),
            )
        rotated = await reader()
        assert rotated is not None
        assert {e.id: e.secrets[0] for e in rotated}[shop.endpoint_id] == "whsec_bmV3"

        factory.conn.execute(
            "DELETE FROM payhook.webhook_endpoints WHERE id = %s", (other.endpoint_id,)
        )
        removed = await reader()
        assert removed is not None and [e.id for e in removed] == [shop.endpoint_id]
    finally:
        await reader.close()

    # The counter's row deleted by hand: every refresh reads the whole table,
    # never an empty copy, and the next change puts the row back, moved on.
    factory.conn.execute("DELETE FROM payhook.endpoint_version")
    reader = PostgresEndpoints(ingress_settings.database_url, TEST_KEYRING)
    try:
        for _ in range(2):
            unversioned = await reader()
            assert unversioned is not None and [e.id for e in unversioned] == [shop.endpoint_id]
        factory.shop()
        back = await reader()
        assert back is not None and len(back) == 2
        assert await reader() is None
    finally:
        await reader.close()

    always = PostgresEndpoints(ingress_settings.database_url, TEST_KEYRING, full_reload=0)
    try:
        assert await always() is not None and await always() is not None
    finally:
        await always.close()


async def test_other_methods_are_405_and_queue_nothing(harness: Harness, factory: Factory) -> None:
    shop = factory.shop()
    await refresh(harness)
    for method in ("GET", "PUT", "HEAD"):
        response = await harness.client.request(method, f"/webhooks/{shop.endpoint_id}")
        assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert harness.jobs() == []


async def test_paths_beside_the_webhook_route_are_starlettes_404(
    harness: Harness, factory: Factory
) -> None:
    shop, body, headers = await signed_event(harness, factory)
    for path in ("/webhooks/", f"/webhooks/{shop.endpoint_id}/more", "/webhooks"):
        response = await harness.client.post(path, content=body, headers=headers)
        assert response.status_code == 404, path
    assert harness.jobs() == []


async def test_under_a_root_path_starlette_routes_webhooks_to_the_same_receiver(
    ingress_settings: Settings, factory: Factory
) -> None:
    # With `--root-path` the path keeps its prefix, so the fast path passes it
    # on; Starlette strips the prefix and routes it to the same receiver.
    async with running(ingress_settings) as harness:
        shop, body, headers = await signed_event(harness, factory)
        transport = httpx.ASGITransport(app=harness.app, root_path="/payhook")
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            accepted = await client.post(
                f"/payhook/webhooks/{shop.endpoint_id}", content=body, headers=headers
            )
            unknown = await client.post(f"/payhook/webhooks/{uuid.uuid4()}", content=body)
        assert accepted.status_code == 202
        assert [job.id for job in harness.jobs()] == [accepted.json()["delivery_id"]]
        assert (unknown.status_code, unknown.json()) == (404, {"error": "not_found"})


async def test_an_unexpected_error_is_a_500_logged_and_raised(
    harness: Harness, factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The webhook route bypasses Starlette's middleware, so it answers the 500
    that middleware would, and raises on for the server to log the error."""
    shop = factory.shop()
    await refresh(harness)

    class Broken(Exception):
        pass

    def broken(*args: Any) -> None:
        raise Broken("the gateway module broke")

    monkeypatch.setattr("ingress.routes.read_event_id", broken)
    event = StandardEvent()
    body = event.body()
    # Raised on to the server: an in-process client sees the error itself.
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=harness.app, raise_app_exceptions=False),
        base_url="http://ingress",
    )
    with capture_logs() as logs:
        response = await client.post(
            f"/webhooks/{shop.endpoint_id}", content=body, headers=event.headers(shop.secret, body)
        )
        with pytest.raises(Broken):
            await harness.post(shop.endpoint_id, body, event.headers(shop.secret, body))
    await client.aclose()
    assert response.status_code == 500 and response.json() == {"error": "internal_error"}
    lines = [line for line in logs if line["event"] == "webhook_received"]
    assert [line["status"] for line in lines] == [500, 500]
    assert harness.jobs() == []


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"webhook-id": "msg_1", "webhook-timestamp": "1700000000"},
        {"webhook-id": "msg_1", "webhook-timestamp": "soon", "webhook-signature": "v1,AAAA"},
        {"webhook-timestamp": "1700000000", "webhook-signature": "v1,AAAA"},
    ],
)
async def test_missing_or_malformed_signature_headers_are_400(
    harness: Harness, factory: Factory, headers: dict[str, str]
) -> None:
    shop = factory.shop()
    await refresh(harness)
    response = await harness.post(shop.endpoint_id, StandardEvent().body(), headers)
    assert response.status_code == 400
    assert response.json() == {"error": "bad_request"}
    assert harness.jobs() == []


async def test_a_signature_header_over_the_limit_is_400_however_it_was_signed(
    harness: Harness, factory: Factory
) -> None:
    shop, body, headers = await signed_event(harness, factory)
    # The valid signature, after a megabyte of empty entries.
    headers["webhook-signature"] = "v1, " * 2**18 + headers["webhook-signature"]
    response = await harness.post(shop.endpoint_id, body, headers)
    assert response.status_code == 400
    assert response.json() == {"error": "bad_request"}
    assert harness.jobs() == []


async def test_header_bytes_beyond_ascii_are_refused_not_a_500(
    harness: Harness, factory: Factory
) -> None:
    """Header values arrive as bytes; one that is not ASCII where base64 or digits
    are expected is a refusal, like any other bad signature, never a 500."""
    shop, body, good = await signed_event(harness, factory)
    for name, value in (
        ("webhook-signature", b"v1,\xe9"),
        ("webhook-signature", b"v1,\xe9 " + good["webhook-signature"].encode()),
        ("webhook-timestamp", b"\xb9\xb2"),
    ):
        sent = {k.encode(): v.encode() for k, v in good.items()} | {name.encode(): value}
        response = await harness.client.post(
            f"/webhooks/{shop.endpoint_id}", content=body, headers=sent
        )
        if value.startswith(b"v1,\xe9 "):  # the authentic signature is still there
            assert response.status_code == 202, value
        else:
            assert response.status_code in (400, 401), (value, response.status_code)
    assert len(harness.jobs()) == 1


async def test_a_stored_secret_that_is_not_whsec_base64_does_not_stop_the_others(
    harness: Harness, factory: Factory
) -> None:
    """The commands refuse such a secret; one written some other way (or a
    NULL) is passed over, and the endpoint's good secrets still verify."""
    shop = factory.shop()
    with pytest.raises(PayhookError, match="--secret"):
        admin.rotate_endpoint_secret(
            factory.conn, shop.endpoint_id, "whsec_not base64!", keyring=TEST_KEYRING
        )
    factory.conn.execute(
        "UPDATE payhook.webhook_endpoints"
        " SET secrets = array_prepend(NULL::text, array_prepend('whsec_é!', secrets))"
        " WHERE id = %s",
        (shop.endpoint_id,),
    )
    await refresh(harness)
    event = StandardEvent()
    response = await harness.post(shop.endpoint_id, event.body(), event.headers(shop.secret))
    assert response.status_code == 202


async def test_body_over_the_limit_is_413_declared_or_streamed(
    database: str, redis_conn: Redis, factory: Factory
) -> None:
    shop = factory.shop()
    settings = test_settings(database, PAYHOOK_MAX_BODY="2048")
    event = StandardEvent(extra={"note": "x" * 1800})
    body = event.body()
    assert len(body) <= 2048
    big = StandardEvent(extra={"note": "x" * 4000})

    async def streamed() -> AsyncIterable[bytes]:
        for _ in range(1000):
            yield b"x" * 1024

    async with running(settings) as harness:
        declared = await harness.post(shop.endpoint_id, big.body(), big.headers(shop.secret))
        chunked = await harness.post(shop.endpoint_id, streamed(), big.headers(shop.secret))
        at_limit = await harness.post(shop.endpoint_id, body, event.headers(shop.secret, body))
        assert [declared.status_code, chunked.status_code] == [413, 413]
        assert declared.json() == {"error": "payload_too_large"}
        assert declared.headers["connection"] == "close"
        assert at_limit.status_code == 202
        assert [job.id for job in harness.jobs()] == [at_limit.json()["delivery_id"]]


async def test_a_body_slower_than_the_read_timeout_is_408_and_queues_nothing(
    database: str, redis_conn: Redis, factory: Factory
) -> None:
    """Under a server that gives no deadline of its own, the body gets the whole timeout."""
    shop = factory.shop()
    settings = test_settings(database, PAYHOOK_READ_TIMEOUT="1s")
    event = StandardEvent()
    body = event.body()

    async def trickled() -> AsyncIterable[bytes]:
        for byte in body:
            yield bytes([byte])
            await asyncio.sleep(0.1)

    async with running(settings) as harness:
        with capture_logs() as logs:
            slow = await harness.post(shop.endpoint_id, trickled(), event.headers(shop.secret))
        assert slow.status_code == 408
        assert slow.json() == {"error": "request_timeout"}
        assert slow.headers["connection"] == "close"
        assert [line["reason"] for line in logs if line["event"] == "webhook_received"] == [
            "read_timeout"
        ]
        assert harness.jobs() == []
        on_time = await harness.post(shop.endpoint_id, body, event.headers(shop.secret, body))
        assert on_time.status_code == 202


# -- outages -------------------------------------------------------------------------


async def test_unreachable_redis_is_503_with_retry_after(
    database: str, redis_conn: Redis, factory: Factory
) -> None:
    shop = factory.shop()
    nowhere = f"redis://127.0.0.1:{spare_port()}/0"
    settings = test_settings(database, REDIS_URL=nowhere, PAYHOOK_ENQUEUE_TIMEOUT="1s")
    async with running(settings) as harness:
        for _ in range(3):
            event = StandardEvent()
            response = await harness.post(
                shop.endpoint_id, event.body(), event.headers(shop.secret)
            )
            assert response.status_code == 503
            assert response.headers["retry-after"] == "5"
            assert response.json() == {"error": "unavailable"}
        ready = await harness.client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["redis"] is False


async def test_a_connection_redis_closed_while_idle_is_replaced_not_a_503(
    harness: Harness, factory: Factory
) -> None:
    """Redis drops idle clients (its `timeout`, a restart, a proxy's idle
    limit): the next request must get a fresh connection, not a 503 from the
    dead one, and the probes likewise."""
    shop = factory.shop()
    await refresh(harness)

    async def accepted() -> int:
        event = StandardEvent()
        response = await harness.post(shop.endpoint_id, event.body(), event.headers(shop.secret))
        return response.status_code

    assert await accepted() == 202
    assert (await harness.client.get("/readyz")).json()["redis"] is True
    killed = harness.redis.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 2, "the writer's and the probe's connections"
    await asyncio.sleep(0.2)
    assert [await accepted() for _ in range(3)] == [202, 202, 202]
    assert (await harness.client.get("/readyz")).json()["redis"] is True
    assert len(harness.jobs()) == 4


async def test_endpoints_never_loaded_are_503_not_404(
    ingress_settings: Settings, factory: Factory
) -> None:
    shop = factory.shop()

    async def down() -> list[Endpoint]:
        raise psycopg.OperationalError("connection refused")

    async with running(ingress_settings, load_endpoints=down) as harness:
        event = StandardEvent()
        response = await harness.post(shop.endpoint_id, event.body(), event.headers(shop.secret))
        assert response.status_code == 503 and "retry-after" in response.headers
        ready = await harness.client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["endpoints"] is False


async def test_postgresql_outage_keeps_known_endpoints_accepting(
    ingress_settings: Settings, factory: Factory
) -> None:
    """The last good copy serves; events queued meanwhile are applied once it is back."""
    reader = PostgresEndpoints(ingress_settings.database_url, TEST_KEYRING)
    up = True

    async def switchable() -> list[Endpoint] | None:
        if not up:
            raise psycopg.OperationalError("connection refused")
        return await reader()

    shop = factory.shop()
    order_id = factory.order(shop)
    async with running(ingress_settings, load_endpoints=switchable) as harness:
        up = False
        assert not await refresh(harness)
        late = factory.shop()  # created during the outage: unknown until it ends
        event = StandardEvent()
        accepted = await harness.post(shop.endpoint_id, event.body(), event.headers(shop.secret))
        unknown = await harness.post(late.endpoint_id, event.body(), event.headers(late.secret))
        assert (accepted.status_code, unknown.status_code) == (202, 404)
        assert (await harness.client.get("/readyz")).status_code == 200

        up = True
        assert await refresh(harness)
        second = StandardEvent()
        again = await harness.post(late.endpoint_id, second.body(), second.headers(late.secret))
        assert again.status_code == 202
    await reader.close()
    outcomes = [result["outcome"] for result in drain(ingress_settings)]
    assert outcomes == ["applied", "unmapped_order"]
    assert factory.order_state(shop, order_id) == "paid"


# -- tenants -------------------------------------------------------------------------


async def test_body_naming_another_tenant_changes_nothing_of_it(
    harness: Harness, factory: Factory
) -> None:
    """Tenant A's endpoint receives a body naming B's tenant, order and references."""
    a, b = factory.shop(), factory.shop()
    b_order = factory.order(b, merchant_reference="b-order", gateway_order_id="pi_b")
    await refresh(harness)
    event = StandardEvent(
        gateway_order_id="pi_b",
        merchant_reference="b-order",
        extra={"tenant_id": b.tenant_id, "endpoint_id": b.endpoint_id},
    )
    body = event.body()
    response = await harness.post(a.endpoint_id, body, event.headers(a.secret, body))
    assert response.status_code == 202
    # Signed with B's secret but sent to A's endpoint: not authentic for A.
    forged = StandardEvent(gateway_order_id="pi_b", merchant_reference="b-order")
    refused = await harness.post(a.endpoint_id, forged.body(), forged.headers(b.secret))
    assert refused.status_code == 401

    assert [result["outcome"] for result in drain(harness.settings)] == ["unmapped_order"]
    assert factory.order_state(b, b_order) == "pending"
    assert factory.count("payment_event_receipts", tenant_id=b.tenant_id) == 0
    assert factory.count("payment_order_transitions", tenant_id=b.tenant_id) == 0
    assert factory.count("payment_outbox", tenant_id=b.tenant_id) == 0
    assert factory.count("payment_event_receipts", tenant_id=a.tenant_id) == 1


# -- observability -------------------------------------------------------------------


async def test_one_log_line_per_request_without_payload_or_secret(
    harness: Harness, factory: Factory
) -> None:
    shop = factory.shop()
    await refresh(harness)
    event = StandardEvent(merchant_reference="secret-order-ref")
    body = event.body()
    with capture_logs() as logs:
        accepted = await harness.post(shop.endpoint_id, body, event.headers(shop.secret, body))
        refused = await harness.post(shop.endpoint_id, body, event.headers("whsec_AAAA", body))
    lines = [line for line in logs if line["event"] == "webhook_received"]
    assert len(lines) == 2
    ok, bad = lines
    assert ok["status"] == 202 and bad["status"] == 401
    assert ok["delivery_id"] == accepted.json()["delivery_id"]
    assert ok["event_id"] == event.event_id
    assert ok["endpoint_id"] == shop.endpoint_id and ok["tenant_id"] == shop.tenant_id
    assert isinstance(ok["duration_ms"], float)
    assert bad["reason"] == "signature_mismatch" and refused.json() == {"error": "unauthorized"}
    text = json.dumps(logs, default=str)
    assert shop.secret not in text and "secret-order-ref" not in text
    assert (
        body.decode() not in text
        and event.headers(shop.secret, body)["webhook-signature"] not in text
    )


async def test_probes_and_metrics(harness: Harness, factory: Factory) -> None:
    shop = factory.shop()
    await refresh(harness)
    event = StandardEvent()
    await harness.post(shop.endpoint_id, event.body(), event.headers(shop.secret))
    await harness.post(shop.endpoint_id, event.body(), event.headers("whsec_AAAA"))
    await harness.post(str(uuid.uuid4()), b"{}", {})

    assert (await harness.client.get("/healthz")).json() == {"status": "ok"}
    ready = await harness.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "redis": True, "endpoints": True}
    metrics = (await harness.client.get("/metrics")).text
    for sample in (
        'payhook_ingress_requests_total{gateway="standard",status="202"} 1.0',
        'payhook_ingress_requests_total{gateway="standard",status="401"} 1.0',
        'payhook_ingress_requests_total{gateway="none",status="404"} 1.0',
        'payhook_ingress_signature_failures_total{gateway="standard",reason="signature_mismatch"}'
        " 1.0",
        "payhook_ingress_enqueue_seconds_count 1.0",
        "payhook_ingress_queue_depth 1.0",
        "payhook_ingress_endpoints 1.0",
        'payhook_ingress_endpoint_refreshes_total{result="ok"} 2.0',
    ):
        assert sample in metrics


async def test_probes_however_many_never_take_the_writers_connection(
    database: str, redis_conn: Redis, factory: Factory
) -> None:
    """`/readyz` and `/metrics` are unauthenticated: a flood of them must not
    turn webhooks into 503s. Every probe connection is held here, as by
    probes stuck on a slow Redis: webhooks are still queued, probes time out."""
    shop = factory.shop()
    settings = test_settings(database, PAYHOOK_ENQUEUE_TIMEOUT="1s")
    async with running(settings) as harness:
        probes = harness.ingress.enqueuer.redis.connection_pool
        held = [await probes.get_connection() for _ in range(probes.max_connections)]
        try:
            for _ in range(3):
                event = StandardEvent()
                response = await harness.post(
                    shop.endpoint_id, event.body(), event.headers(shop.secret)
                )
                assert response.status_code == 202
            ready = await harness.client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["redis"] is False
        finally:
            for connection in held:
                await probes.release(connection)
        assert (await harness.client.get("/readyz")).status_code == 200
        assert len(harness.jobs()) == 3


async def test_the_cache_holds_opened_secrets_and_a_copied_one_verifies_nothing(
    harness: Harness, factory: Factory
) -> None:
    """A sealed secret copied from another endpoint's row does not open: that
    endpoint refuses the copy's signatures, every other endpoint is served."""
    victim, attacker = factory.shop(), factory.shop()
    factory.conn.execute(
        "UPDATE payhook.webhook_endpoints AS v SET secrets = a.secrets"
        "  FROM payhook.webhook_endpoints AS a WHERE v.id = %s AND a.id = %s",
        (victim.endpoint_id, attacker.endpoint_id),
    )
    with capture_logs() as logs:
        assert await refresh(harness)
    [line] = [entry for entry in logs if entry["event"] == "endpoint_secret_unopenable"]
    assert line["endpoint_id"] == victim.endpoint_id and attacker.secret not in str(line)
    cached = harness.ingress.cache.get(attacker.endpoint_id)
    assert cached is not None and cached.secrets == (attacker.secret,)

    event = StandardEvent()
    body = event.body()
    forged = await harness.post(victim.endpoint_id, body, event.headers(attacker.secret, body))
    assert forged.status_code == 401
    own = await harness.post(attacker.endpoint_id, body, event.headers(attacker.secret, body))
    assert own.status_code == 202
