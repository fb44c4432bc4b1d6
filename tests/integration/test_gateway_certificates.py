"""PayPal through the real ingress and consumer: a pinned certificate needs no
network; a certificate URL outside PayPal is refused; one that cannot be
fetched is a 503, for PayPal to retry."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from control import admin
from control.cli import build_parser
from control.sender import Event as SendEvent
from control.sender import sign_event
from payhook.errors import PayhookError
from payhook.gateways import GATEWAYS, paypal
from payhook.gateways.base import Config
from payhook.gateways.paypal import PayPalGateway
from payhook.settings import Settings
from tests.certificates import Issued, authority, leaf
from tests.factories import TEST_KEYRING, Factory, Shop
from tests.harness import Harness, drain, refresh

pytestmark = pytest.mark.anyio
WEBHOOK_ID = "8PT597110X687430LKGECATA"
CERT_URL = "https://api.paypal.com/v1/notifications/certs/CERT-360caa42-test"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def ca() -> Issued:
    return authority()


@pytest.fixture(scope="module")
def signer(ca: Issued) -> Issued:
    return leaf(ca)


class Fetches:
    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body, self.urls = status, body, list[str]()

    def __call__(self, url: str, timeout: float) -> tuple[int, bytes]:
        self.urls.append(url)
        return self.status, self.body


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch, signer: Issued) -> Iterator[Fetches]:
    """PayPal's certificate URLs, answered here: the gateway the ingress and
    the consumer share fetches through it."""
    fetch = Fetches(200, signer.pem.encode())
    monkeypatch.setitem(GATEWAYS, "paypal", PayPalGateway(fetch=fetch))
    yield fetch


def paypal_shop(factory: Factory, config: Config) -> Shop:
    tenant = admin.add_tenant(factory.conn, "paypal-shop", keyring=TEST_KEYRING)
    endpoint = admin.add_endpoint(
        factory.conn, tenant, "paypal", WEBHOOK_ID, keyring=TEST_KEYRING, config=config
    )
    return Shop(tenant, endpoint.endpoint_id, WEBHOOK_ID, "paypal")


def send(
    signer: Issued, event_type: str, capture: str, amount: str, url: str = CERT_URL
) -> tuple[bytes, dict[str, str]]:
    whole, _, cents = amount.partition(".")
    minor = int(whole) * 100 + int(cents or 0)
    event = SendEvent("paypal", event_type, capture, minor, "USD", "order-p1")
    config = Config({"cert_url": url}, {"signing_key": signer.key_pem})
    request = sign_event(event, WEBHOOK_ID, int(time.time()), config)
    return request.body, request.headers


async def test_a_pinned_certificate_verifies_at_the_ingress_and_the_consumer_with_no_request(
    harness: Harness, factory: Factory, fetches: Fetches, signer: Issued, ingress_settings: Settings
) -> None:
    shop = paypal_shop(factory, Config({"certificates": signer.pem}))
    order = factory.order(shop, "order-p1", "CAPTURE1", 1050, "USD")
    await refresh(harness)
    body, headers = send(signer, "PAYMENT.CAPTURE.COMPLETED", "CAPTURE1", "10.50")
    response = await harness.post(shop.endpoint_id, body, headers)
    assert response.status_code == 202
    body, headers = send(signer, "PAYMENT.CAPTURE.REFUNDED", "CAPTURE1", "4.00")
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 202
    assert [r["outcome"] for r in drain(ingress_settings)] == ["applied", "applied"]
    assert factory.order_state(shop, order) == "partially_refunded"
    assert fetches.urls == []


async def test_a_fetched_certificate_is_fetched_once_and_chained(
    harness: Harness,
    factory: Factory,
    fetches: Fetches,
    signer: Issued,
    ca: Issued,
    ingress_settings: Settings,
) -> None:
    shop = paypal_shop(factory, Config({"trust_anchors": ca.pem}))
    order = factory.order(shop, "order-p1", "CAPTURE2", 1050, "USD")
    await refresh(harness)
    body, headers = send(signer, "PAYMENT.CAPTURE.COMPLETED", "CAPTURE2", "10.50")
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 202
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 202
    assert sorted(r["outcome"] for r in drain(ingress_settings)) == ["applied", "duplicate"]
    assert factory.order_state(shop, order) == "paid"
    assert fetches.urls == [CERT_URL]  # the ingress fetched; the consumer found it cached


async def test_a_certificate_url_outside_paypal_is_401_with_no_request_made(
    harness: Harness, factory: Factory, fetches: Fetches, signer: Issued, ca: Issued
) -> None:
    shop = paypal_shop(factory, Config({"trust_anchors": ca.pem}))
    await refresh(harness)
    url = "https://127.0.0.1/v1/notifications/certs/CERT-1"
    body, headers = send(signer, "PAYMENT.CAPTURE.COMPLETED", "CAPTURE3", "1.00", url)
    response = await harness.post(shop.endpoint_id, body, headers)
    assert response.status_code == 401
    assert harness.jobs() == [] and fetches.urls == []


async def test_a_certificate_that_cannot_be_fetched_is_503_then_accepted(
    harness: Harness,
    factory: Factory,
    fetches: Fetches,
    signer: Issued,
    ca: Issued,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paypal, "FAILED_TTL", 0.5)
    shop = paypal_shop(factory, Config({"trust_anchors": ca.pem}))
    await refresh(harness)
    fetches.status = 502
    body, headers = send(signer, "PAYMENT.CAPTURE.COMPLETED", "CAPTURE4", "1.00")
    response = await harness.post(shop.endpoint_id, body, headers)
    assert response.status_code == 503 and "retry-after" in response.headers
    assert harness.jobs() == []
    fetches.status = 200
    # PayPal retries at once: still 503, and no second request to the URL.
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 503
    assert fetches.urls == [CERT_URL]
    await asyncio.sleep(0.6)
    assert (await harness.post(shop.endpoint_id, body, headers)).status_code == 202
    assert fetches.urls == [CERT_URL, CERT_URL]


async def test_endpoints_add_takes_the_webhook_id_and_pinned_certificates(
    factory: Factory,
    settings: Settings,
    signer: Issued,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tenant = admin.add_tenant(factory.conn, "paypal-cli", keyring=TEST_KEYRING)
    add = ["endpoints", "add", "--tenant", tenant, "--gateway", "paypal"]
    args = build_parser().parse_args(add)
    with pytest.raises(PayhookError, match="PayPal assigns the webhook id"):
        args.func(args, settings)
    pem = tmp_path / "paypal.pem"
    pem.write_text(signer.pem)
    args = build_parser().parse_args(
        [*add, "--secret", WEBHOOK_ID, "--setting", f"certificates=@{pem}"]
    )
    assert args.func(args, settings) == 0
    endpoint = json.loads(capsys.readouterr().out)
    row = factory.conn.execute(
        "SELECT settings FROM payhook.webhook_endpoints WHERE id = %s", (endpoint["endpoint_id"],)
    ).fetchone()
    assert row is not None and row["settings"]["certificates"] == signer.pem
