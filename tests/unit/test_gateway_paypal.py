"""PayPal: SHA256withRSA over the transmission, checked with PayPal's certificate."""

from __future__ import annotations

import base64
import json
import threading
import time
import zlib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from payhook.errors import (
    GatewayUnavailable,
    MalformedEvent,
    MalformedHeaders,
    SignatureMismatch,
    TimestampOutOfTolerance,
    UntrustedCertificate,
)
from payhook.gateways.base import NO_CONFIG, Config, Sample
from payhook.gateways.paypal import MAX_FETCHES, CertificateCache, PayPalGateway
from tests.certificates import Issued, authority, leaf

FIXTURES = Path(__file__).parents[1] / "fixtures" / "paypal"
CERT_URL = "https://api.sandbox.paypal.com/v1/notifications/certs/CERT-test-1"
WEBHOOK_ID = "8PT597110X687430LKGECATA"


class Fetches:
    """A certificate URL's answers, counted; any request to it is recorded."""

    def __init__(self, status: int = 200, body: bytes = b"") -> None:
        self.status, self.body = status, body
        self.urls: list[str] = []

    def __call__(self, url: str, timeout: float) -> tuple[int, bytes]:
        self.urls.append(url)
        return self.status, self.body


def recorded(name: str) -> tuple[bytes, dict[str, str]]:
    body = (FIXTURES / f"{name}.json").read_bytes()
    headers = json.loads((FIXTURES / f"{name}.headers.json").read_text())
    return body, {k: v for k, v in headers.items() if k.startswith("paypal-")}


def full_verify(
    gateway: PayPalGateway,
    headers: dict[str, str],
    body: bytes,
    secrets: list[str],
    config: Config = NO_CONFIG,
    now: float | None = None,
) -> None:
    """As the ingress does: fetch what is missing, then verify."""
    fetch = gateway.fetcher(headers, config)
    if fetch is not None:
        fetch(5.0)
    tolerance = None if now is None else gateway.tolerance
    gateway.verify(headers, body, secrets, now=now, tolerance=tolerance, config=config)


@pytest.mark.parametrize(
    "name", ["payment_capture_completed", "payment_capture_refunded", "payment_capture_declined"]
)
def test_paypals_recorded_deliveries_verify_with_its_certificate_and_chain(name: str) -> None:
    """Real deliveries of PayPal's webhook simulator, signed with PayPal's 2024
    certificate (expired since: checked at the transmission time, as the
    consumer does), chained to the DigiCert authorities payhook bundles."""
    body, headers = recorded(name)
    pem = (FIXTURES / "certs" / "CERT-360caa42-fca2a594-1a5f47cb.pem").read_bytes()
    fetches = Fetches(body=pem)
    gateway = PayPalGateway(fetch=fetches)
    full_verify(gateway, headers, body, ["WEBHOOK_ID"])
    assert fetches.urls == [headers["paypal-cert-url"]]
    full_verify(gateway, headers, body, ["another", "WEBHOOK_ID"])
    assert len(fetches.urls) == 1  # cached
    with pytest.raises(SignatureMismatch):
        full_verify(gateway, headers, body + b" ", ["WEBHOOK_ID"])
    with pytest.raises(SignatureMismatch):
        full_verify(gateway, headers, body, [WEBHOOK_ID])
    # Now, long after the transmission: stale.
    with pytest.raises(TimestampOutOfTolerance):
        full_verify(gateway, headers, body, ["WEBHOOK_ID"], now=time.time())


def test_paypals_sdk_vector_signs_the_documented_string() -> None:
    """PayPal's Java SDK test: its signature over `id|time|webhook id|crc32`
    verifies with its sandbox certificate; the CRC is the unsigned one."""
    body = (FIXTURES / "vectors" / "java_sdk_billing_plan_created.json").read_bytes()
    headers = json.loads(
        (FIXTURES / "vectors" / "java_sdk_billing_plan_created.headers.json").read_text()
    )
    headers = {k.lower(): v for k, v in headers.items()}
    certificate = x509.load_pem_x509_certificate(
        (FIXTURES / "certs" / "java-sdk-testClientCert-sandbox.pem").read_bytes()
    )
    crc = zlib.crc32(body)
    assert crc >= 2**31  # the signed form would differ
    message = (
        f"{headers['paypal-transmission-id']}|{headers['paypal-transmission-time']}"
        f"|96605875FF6516633|{crc}"
    )
    key = certificate.public_key()
    assert isinstance(key, rsa.RSAPublicKey)
    key.verify(
        base64.b64decode(headers["paypal-transmission-sig"]),
        message.encode(),
        padding.PKCS1v15(),
        hashes.SHA256(),
    )


@pytest.fixture(scope="module")
def ca() -> Issued:
    return authority()


@pytest.fixture(scope="module")
def signer(ca: Issued) -> Issued:
    return leaf(ca)


def signed(
    signer: Issued, event_type: str = "PAYMENT.CAPTURE.COMPLETED", url: str = CERT_URL, **kw: Any
) -> tuple[bytes, dict[str, str]]:
    sample = Sample(
        "WH-1",
        event_type,
        "5O190127TN364715T",
        kw.pop("amount", 1050),
        kw.pop("currency", "EUR"),
        "order-9",
        int(time.time()),
    )
    config = Config({"cert_url": url}, {"signing_key": signer.key_pem})
    return PayPalGateway().sample_request([sample], WEBHOOK_ID, int(time.time()), config)


def test_a_pinned_certificate_verifies_with_no_request_made(signer: Issued) -> None:
    body, headers = signed(signer)
    fetches = Fetches()
    gateway = PayPalGateway(fetch=fetches)
    pinned = Config({"certificates": signer.pem})
    full_verify(gateway, headers, body, [WEBHOOK_ID], pinned, now=time.time())
    assert fetches.urls == []
    other = leaf(authority("another CA"))
    with pytest.raises(SignatureMismatch):
        full_verify(gateway, headers, body, [WEBHOOK_ID], Config({"certificates": other.pem}))


def test_a_fetched_certificate_must_chain_to_the_trust_anchors(ca: Issued, signer: Issued) -> None:
    body, headers = signed(signer)
    anchors = Config({"trust_anchors": ca.pem})
    gateway = PayPalGateway(fetch=Fetches(body=signer.pem.encode()))
    full_verify(gateway, headers, body, [WEBHOOK_ID], anchors, now=time.time())
    # PayPal's default anchors (DigiCert) do not vouch for the test CA.
    with pytest.raises(UntrustedCertificate):
        full_verify(
            PayPalGateway(fetch=Fetches(body=signer.pem.encode())), headers, body, [WEBHOOK_ID]
        )
    # A certificate of another authority, or for another host, or expired.
    for bad in (
        leaf(authority("another CA")),
        leaf(ca, "webhooks.example.com"),
        leaf(ca, valid_from=datetime.now(UTC) - timedelta(days=60), days=30),
    ):
        body, headers = signed(bad)
        gateway = PayPalGateway(fetch=Fetches(body=bad.pem.encode()))
        with pytest.raises(UntrustedCertificate):
            full_verify(gateway, headers, body, [WEBHOOK_ID], anchors)


@pytest.mark.parametrize(
    "url",
    [
        "https://evil.example.com/v1/notifications/certs/CERT-1",
        "https://api.paypal.com.evil.example/v1/notifications/certs/CERT-1",
        "http://api.paypal.com/v1/notifications/certs/CERT-1",
        "https://api.paypal.com:8443/v1/notifications/certs/CERT-1",
        "https://user@api.paypal.com/v1/notifications/certs/CERT-1",
        "https://api.paypal.com/v1/oauth2/token",
        "https://paypal.com/v1/notifications/certs/CERT-1",
        "https://127.0.0.1/v1/notifications/certs/CERT-1",
    ],
)
def test_a_certificate_url_outside_paypal_is_refused_without_a_request(
    signer: Issued, url: str
) -> None:
    body, headers = signed(signer, url=url)
    fetches = Fetches(body=signer.pem.encode())
    gateway = PayPalGateway(fetch=fetches)
    with pytest.raises(UntrustedCertificate):
        full_verify(gateway, headers, body, [WEBHOOK_ID])
    with pytest.raises(UntrustedCertificate):
        # Pinned or not, the URL is PayPal's or the request is not.
        full_verify(gateway, headers, body, [WEBHOOK_ID], Config({"certificates": signer.pem}))
    assert fetches.urls == []


@pytest.mark.parametrize(("status", "body"), [(500, b""), (404, b""), (200, b"not a PEM")])
def test_a_certificate_that_cannot_be_fetched_is_unavailable(status: int, body: bytes) -> None:
    fetches = Fetches(status, body)
    gateway = PayPalGateway(fetch=fetches, cache=CertificateCache())
    fetch = gateway.fetcher({"paypal-cert-url": CERT_URL}, Config())
    assert fetch is not None
    with pytest.raises(GatewayUnavailable):
        fetch(1.0)
    assert gateway.cache.get(CERT_URL) is None


@pytest.mark.parametrize(
    "header", ["paypal-transmission-id", "paypal-transmission-sig", "paypal-auth-algo"]
)
def test_missing_or_malformed_headers(signer: Issued, header: str) -> None:
    body, headers = signed(signer)
    pinned = Config({"certificates": signer.pem})
    with pytest.raises(MalformedHeaders):
        full_verify(PayPalGateway(), headers | {header: ""}, body, [WEBHOOK_ID], pinned)
    with pytest.raises(MalformedHeaders):
        bad = headers | {"paypal-auth-algo": "SHA1withRSA", "paypal-transmission-sig": "!"}
        full_verify(PayPalGateway(), bad, body, [WEBHOOK_ID], pinned)


def parse(name: str) -> Any:
    return PayPalGateway().parse({}, (FIXTURES / f"{name}.json").read_bytes())


def test_paypals_sample_events_map_to_orders() -> None:
    completed = parse("payment_capture_completed")
    assert completed.kind == "succeeded" and completed.amount_minor is not None
    refunded = parse("payment_capture_refunded")
    assert (refunded.kind, refunded.gateway_order_id) == ("refunded", "0JF852973C016714D")
    assert (refunded.amount_minor, refunded.currency, refunded.cumulative) == (99, "USD", False)
    denied = parse("payment_capture_denied")
    assert denied.kind == "failed"
    dispute = parse("customer_dispute_created")
    assert (dispute.kind, dispute.gateway_order_id) == ("disputed", "00D10444LD479031K")
    assert (dispute.amount_minor, dispute.currency) == (300, "USD")
    declined = parse("payment_capture_declined")
    assert declined.kind == "failed" and declined.merchant_reference is not None


@pytest.mark.parametrize(
    ("currency", "value", "minor"),
    [("JPY", "1050", 1050), ("KWD", "10.505", 10505), ("EUR", "10.5", 1050)],
)
def test_decimal_amounts_are_read_by_the_currencys_exponent(
    signer: Issued, currency: str, value: str, minor: int
) -> None:
    event = json.loads((FIXTURES / "payment_capture_completed.json").read_bytes())
    event["resource"]["amount"] = {"currency_code": currency, "value": value}
    parsed = PayPalGateway().parse({}, json.dumps(event).encode())
    assert (parsed.amount_minor, parsed.currency) == (minor, currency)


def test_an_amount_finer_than_the_currency_is_malformed_never_rounded() -> None:
    event = json.loads((FIXTURES / "payment_capture_completed.json").read_bytes())
    event["resource"]["amount"] = {"currency_code": "EUR", "value": "10.505"}
    with pytest.raises(MalformedEvent, match=r"amount\.value"):
        PayPalGateway().parse({}, json.dumps(event).encode())


def test_what_payhook_send_signs_is_what_paypal_sends(signer: Issued) -> None:
    for event_type in (
        "PAYMENT.CAPTURE.REFUNDED",
        "CUSTOMER.DISPUTE.CREATED",
        "PAYMENT.CAPTURE.DENIED",
    ):
        body, headers = signed(signer, event_type, amount=1050, currency="JPY")
        full_verify(
            PayPalGateway(), headers, body, [WEBHOOK_ID], Config({"certificates": signer.pem})
        )
        event = PayPalGateway().parse({}, body)
        assert (event.amount_minor, event.currency, event.gateway_order_id) == (
            1050,
            "JPY",
            "5O190127TN364715T",
        )


def test_the_webhook_id_is_given_never_made() -> None:
    with pytest.raises(ValueError, match="PayPal assigns"):
        PayPalGateway().generate_secret()
    with pytest.raises(ValueError, match="certificates"):
        PayPalGateway().check_config(Config({"certificates": "not PEM"}))


def test_a_certificate_is_fetched_once_for_requests_arriving_together() -> None:
    class Slow(Fetches):
        def __call__(self, url: str, timeout: float) -> tuple[int, bytes]:
            time.sleep(0.2)
            return super().__call__(url, timeout)

    fetches = Slow(500)
    gateway = PayPalGateway(fetch=fetches)
    errors: list[Exception] = []

    def one() -> None:
        fetch = gateway.fetcher({"paypal-cert-url": CERT_URL}, Config())
        try:
            if fetch is not None:
                fetch(5.0)
        except GatewayUnavailable as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # One fetch failed; the others found it failed and made none.
    assert fetches.urls == [CERT_URL] and len(errors) == 8


def test_certificate_fetches_are_bounded_for_urls_anyone_can_name() -> None:
    fetches = Fetches(500)
    gateway = PayPalGateway(fetch=fetches)
    url = CERT_URL + "-failing"
    fetch = gateway.fetcher({"paypal-cert-url": url}, Config())
    assert fetch is not None
    with pytest.raises(GatewayUnavailable, match="500"):
        fetch(1.0)
    with pytest.raises(GatewayUnavailable, match="failed less than"):
        fetch(1.0)
    assert fetches.urls == [url]
    # Every slot taken (fetches in flight elsewhere): refused without a request.
    taken = [gateway.cache.slots.acquire(blocking=False) for _ in range(MAX_FETCHES)]
    assert all(taken)
    other = gateway.fetcher({"paypal-cert-url": CERT_URL + "-other"}, Config())
    assert other is not None
    with pytest.raises(GatewayUnavailable, match="at once"):
        other(1.0)
    assert fetches.urls == [url]
