"""A gateway is one module: registered in `payhook.gateways.GATEWAYS`, it is
served by the ingress, applied by the consumer and accepted by
`payhook endpoints add`, with nothing else changed, the database included.
An endpoint whose gateway the running release does not know is not served.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime

import pytest

from consumer.handler import Runtime, handle
from control import admin
from control.cli import build_parser
from control.sender import Event as SendEvent
from control.sender import sign_event
from payhook.errors import MalformedHeaders, PayhookError, SignatureMismatch
from payhook.gateways import GATEWAYS, Event
from payhook.gateways.base import (
    NO_CONFIG,
    Config,
    GatewayBase,
    Sample,
    canonical_digest,
    load_json_object,
    one_event,
    raw_digest,
)
from payhook.horizon import minimum_receipt_retention
from payhook.settings import Settings
from tests.factories import TEST_KEYRING, TEST_SECRETS_KEY, Factory, Shop, envelope
from tests.harness import drain, refresh, running


class ToyGateway(GatewayBase):
    """A gateway of the simplest kind: HMAC-SHA256 of the body, in hex."""

    name = "toy"
    signature_headers: tuple[str, ...] = ("toy-signature",)
    tolerance: float = 300
    redelivery_window: float = 90 * 86400.0

    def generate_secret(self) -> str:
        return "toy_" + secrets.token_hex(16)

    def check_secret(self, secret: str) -> None:
        if not secret.startswith("toy_"):
            raise ValueError("a toy secret is toy_ and hex")

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        value = json.loads(body).get("id")
        return value if isinstance(value, str) else None

    def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        secrets: Sequence[str],
        *,
        now: float | None,
        tolerance: float | None,
        config: Config = NO_CONFIG,
    ) -> None:
        given = headers.get("toy-signature", "")
        if not given:
            raise MalformedHeaders()
        for secret in secrets:
            if hmac.compare_digest(sign(secret, body), given):
                return
        raise SignatureMismatch()

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        data = load_json_object(body)
        return Event(
            event_id=data["id"],
            event_type="toy.paid",
            kind="succeeded",
            occurred_at=datetime.fromtimestamp(data["created"], UTC),
            gateway_order_id=data["order"],
            merchant_reference=None,
            amount_minor=data["amount"],
            currency=data["currency"],
            digest=canonical_digest(data),
            meaning=canonical_digest(data),
        )

    def unreadable_digest(self, body: bytes) -> str:
        return raw_digest(body)

    sample_type = "toy.paid"

    def new_event_id(self) -> str:
        return f"toy_{uuid.uuid4().hex}"

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        sample = one_event(samples)
        body = json.dumps(
            {
                "id": sample.event_id,
                "created": sample.occurred_at,
                "order": sample.gateway_order_id,
                "amount": sample.amount,
                "currency": sample.currency,
            }
        ).encode()
        return body, {"toy-signature": sign(secret, body)}


def sign(secret: str, body: bytes) -> str:
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def toy_body(order: str, amount: int = 1999) -> bytes:
    event = {"id": f"toy_{uuid.uuid4().hex}", "created": int(datetime.now(UTC).timestamp())}
    return json.dumps(event | {"order": order, "amount": amount, "currency": "EUR"}).encode()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[ToyGateway]:
    gateway = ToyGateway()
    monkeypatch.setitem(GATEWAYS, gateway.name, gateway)
    yield gateway


@pytest.mark.anyio
async def test_a_gateway_registered_in_its_module_is_served_end_to_end(
    toy: ToyGateway,
    factory: Factory,
    settings: Settings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tenant_id = admin.add_tenant(factory.conn, "toys", keyring=TEST_KEYRING)
    # `payhook endpoints add --gateway toy`, as the command line parses and runs it.
    add = ["endpoints", "add", "--tenant", tenant_id, "--gateway", "toy"]
    args = build_parser().parse_args(add)
    assert args.func(args, settings) == 0
    endpoint = json.loads(capsys.readouterr().out)
    assert endpoint["secret"].startswith("toy_")
    args = build_parser().parse_args([*add, "--secret", "x"])
    with pytest.raises(PayhookError, match="--secret: a toy secret is toy_ and hex"):
        args.func(args, settings)
    order_id = admin.add_order(factory.conn, tenant_id, "toy-1", "order-t1", 1999, "EUR")
    # The longest window of any gateway sets the shortest receipt retention.
    assert minimum_receipt_retention()[1] == "toy"

    # `payhook send --gateway toy` signs it as the gateway would.
    sample = SendEvent("toy", "toy.paid", "order-t1", 1999, "EUR")
    request = sign_event(sample, endpoint["secret"])
    async with running(Settings.from_env(_env(settings))) as harness:
        await refresh(harness)
        forged = await harness.post(
            endpoint["endpoint_id"], request.body, {"toy-signature": sign("toy_o", request.body)}
        )
        assert forged.status_code == 401
        response = await harness.post(endpoint["endpoint_id"], request.body, request.headers)
        assert response.status_code == 202
    [result] = drain(settings)
    assert result["outcome"] == "applied"
    shop = Shop(tenant_id, endpoint["endpoint_id"], endpoint["secret"], "toy")
    assert factory.order_state(shop, order_id) == "paid"


def test_an_endpoint_of_a_gateway_this_release_does_not_know_is_not_served(
    factory: Factory, runtime: Runtime
) -> None:
    """Written by a later release, or by hand: the consumer records
    `unknown_endpoint` rather than fail the job on every retry."""
    shop = factory.shop()
    factory.conn.execute(
        "UPDATE payhook.webhook_endpoints SET gateway = 'later' WHERE id = %s", (shop.endpoint_id,)
    )
    body = toy_body("order-1")
    job = envelope(shop, body, {"toy-signature": "x"})
    assert handle(runtime, job.to_json()).outcome == "unknown_endpoint"
    assert factory.count("security_anomalies", kind="unknown_endpoint") == 1
    with pytest.raises(Exception, match="webhook_endpoints_gateway_name"):
        factory.conn.execute(
            "UPDATE payhook.webhook_endpoints SET gateway = 'Not a name' WHERE id = %s",
            (shop.endpoint_id,),
        )


def _env(settings: Settings) -> dict[str, str]:
    return {
        "DATABASE_URL": str(settings.database_url),
        "REDIS_URL": str(settings.redis_url),
        "PAYHOOK_QUEUE": settings.queue,
        "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
        "PAYHOOK_ENDPOINT_REFRESH": "1h",
    }


@pytest.mark.anyio
async def test_the_ingress_does_not_serve_an_endpoint_of_an_unknown_gateway(
    factory: Factory, settings: Settings
) -> None:
    shop = factory.shop()
    factory.conn.execute(
        "UPDATE payhook.webhook_endpoints SET gateway = 'later' WHERE id = %s", (shop.endpoint_id,)
    )
    async with running(Settings.from_env(_env(settings))) as harness:
        assert await refresh(harness)
        response = await harness.post(shop.endpoint_id, b"{}", {"toy-signature": "x"})
        assert response.status_code == 404
