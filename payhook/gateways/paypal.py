"""PayPal webhooks, verified with PayPal's certificate (no call to its API).

PayPal signs `{transmission id}|{transmission time}|{webhook id}|{crc32}`,
the CRC-32 of the raw body as an unsigned decimal, with SHA256withRSA; the
headers `PAYPAL-TRANSMISSION-ID`, `-TIME`, `-SIG` (base64), `PAYPAL-CERT-URL`
and `PAYPAL-AUTH-ALGO` carry them. PayPal's SDKs sign and check the same
string. The webhook id is the endpoint's secret: the id PayPal gave the
webhook (several during a move to a new one).

The certificate is fetched only from an https URL on a host ending in
`.paypal.com` under `/v1/notifications/certs/`, never from anywhere else (a
request naming another URL is refused before any is made). A fetched
certificate is cached per URL and checked on every use: it chains to the
endpoint's trust anchors (by default DigiCert's, which PayPal's own SDKs
bundle), names a host under `.paypal.com`, and was valid at the
transmission time. An endpoint may pin the certificates instead (the
`certificates` setting): then nothing is fetched, and only those verify.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import secrets as random
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from functools import lru_cache
from importlib import resources
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import httpx
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from payhook import money
from payhook.errors import (
    GatewayUnavailable,
    MalformedEvent,
    MalformedHeaders,
    SignatureMismatch,
    UntrustedCertificate,
)
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    MAX_TEXT,
    NO_CONFIG,
    Config,
    Event,
    GatewayBase,
    Sample,
    Setting,
    canonical_digest,
    check_printable,
    check_settings,
    check_tolerance,
    iso_time,
    json_text,
    load_json_object,
    meaning_digest,
    object_meaning,
    one_event,
    require_currency,
    require_str,
)

#: Event types payhook acts on.
TYPES = {
    "PAYMENT.CAPTURE.COMPLETED": "succeeded",
    "PAYMENT.CAPTURE.DENIED": "failed",
    "PAYMENT.CAPTURE.DECLINED": "failed",
    "PAYMENT.CAPTURE.REFUNDED": "refunded",
    "CUSTOMER.DISPUTE.CREATED": "disputed",
}
HEADERS = (
    "paypal-transmission-id",
    "paypal-transmission-time",
    "paypal-transmission-sig",
    "paypal-cert-url",
    "paypal-auth-algo",
)
ALGORITHM = "SHA256withRSA"
#: Where PayPal's signing certificates are, and nowhere else.
CERT_HOST_SUFFIX = ".paypal.com"
CERT_PATH = "/v1/notifications/certs/"
#: Seconds a fetched certificate is kept before it is fetched again, and
#: how many URLs are kept.
CERT_TTL = 86400.0
CERT_CACHE_SIZE = 64
#: Certificate fetches one process makes at once, seconds a failed URL is not
#: fetched again, and the locks fetches of the same URL wait on.
MAX_FETCHES = 4
FAILED_TTL = 60.0
LOCK_STRIPES = 64
#: Bytes a certificate URL's answer may hold: a chain is a few kilobytes.
MAX_CERT_BYTES = 64 * 1024
#: The capture a refund's `up` link names.
CAPTURE_LINK = "/v2/payments/captures/"


class CertificateCache:
    """Certificates by URL, as fetched (leaf first), for CERT_TTL seconds."""

    def __init__(self, ttl: float = CERT_TTL, size: int = CERT_CACHE_SIZE) -> None:
        self.ttl = ttl
        self.size = size
        self._entries: OrderedDict[str, tuple[list[x509.Certificate], float]] = OrderedDict()
        self._lock = threading.Lock()
        #: Striped locks by URL: requests arriving together for a certificate
        #: not yet cached wait for one fetch, not one each.
        self._stripes = [threading.Lock() for _ in range(LOCK_STRIPES)]
        #: URLs whose fetch failed, and when: not fetched again for FAILED_TTL.
        self._failed: OrderedDict[str, float] = OrderedDict()
        #: Fetches in flight at once, at most: the URL comes from a request
        #: not yet authenticated, so anyone can make payhook fetch.
        self.slots = threading.BoundedSemaphore(MAX_FETCHES)

    def fetch_lock(self, url: str) -> threading.Lock:
        return self._stripes[hash(url) % LOCK_STRIPES]

    def failed_recently(self, url: str) -> bool:
        with self._lock:
            at = self._failed.get(url)
            return at is not None and time.monotonic() - at < FAILED_TTL

    def mark_failed(self, url: str) -> None:
        with self._lock:
            self._failed[url] = time.monotonic()
            self._failed.move_to_end(url)
            while len(self._failed) > 4 * self.size:
                self._failed.popitem(last=False)

    def get(self, url: str) -> list[x509.Certificate] | None:
        with self._lock:
            entry = self._entries.get(url)
            if entry is None or time.monotonic() - entry[1] > self.ttl:
                return None
            return entry[0]

    def put(self, url: str, certificates: list[x509.Certificate]) -> None:
        with self._lock:
            self._entries[url] = (certificates, time.monotonic())
            self._entries.move_to_end(url)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._failed.clear()


#: Fetches a URL with a timeout: its status and body (replaced in tests).
Fetch = Callable[[str, float], tuple[int, bytes]]


def http_fetch(url: str, timeout: float) -> tuple[int, bytes]:
    with httpx.stream("GET", url, timeout=timeout, follow_redirects=False) as response:
        body = b""
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > MAX_CERT_BYTES:
                raise GatewayUnavailable(f"{url}: more than {MAX_CERT_BYTES} bytes")
        return response.status_code, body


def check_cert_url(url: str) -> None:
    """`UntrustedCertificate` unless `url` is where PayPal keeps certificates."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise UntrustedCertificate() from None
    host = parts.hostname or ""
    if (
        parts.scheme != "https"
        or not host.endswith(CERT_HOST_SUFFIX)
        or parts.username is not None
        or port not in (None, 443)
        or not parts.path.startswith(CERT_PATH)
        or parts.query
        or parts.fragment
    ):
        raise UntrustedCertificate()


@lru_cache(maxsize=64)
def load_certificates(pem: str) -> tuple[x509.Certificate, ...]:
    """The certificates of a PEM text (kept: settings repeat on every request)."""
    try:
        return tuple(x509.load_pem_x509_certificates(pem.encode()))
    except ValueError:
        raise ValueError("expected PEM certificates") from None


def default_trust_anchors() -> str:
    return resources.files("payhook.gateways").joinpath("certs/paypal.pem").read_text()


class PayPalGateway(GatewayBase):
    name = "paypal"
    signature_headers: tuple[str, ...] = HEADERS
    settings: Mapping[str, Setting] = MappingProxyType(
        {
            "certificates": Setting(
                "PEM of PayPal's signing certificates to trust, pinned: nothing is "
                "fetched, and only these verify"
            ),
            "trust_anchors": Setting(
                "PEM of the certificate authorities a fetched certificate must chain "
                "to (default: DigiCert's, as PayPal's SDKs bundle them)"
            ),
        }
    )
    #: Seconds a transmission time may differ from payhook's clock.
    tolerance: float = 300
    #: PayPal retries for 3 days; its dashboard resends events for 30.
    redelivery_window: float = 30 * DAY
    sample_type = "PAYMENT.CAPTURE.COMPLETED"

    def __init__(self, fetch: Fetch = http_fetch, cache: CertificateCache | None = None) -> None:
        self.fetch = fetch
        self.cache = cache or CertificateCache()

    def generate_secret(self) -> str:
        raise ValueError("PayPal assigns the webhook id: give it with --secret")

    def check_secret(self, secret: str) -> None:
        check_printable(secret, "a PayPal webhook id")
        if len(secret) > MAX_TEXT:
            raise ValueError(f"a PayPal webhook id holds at most {MAX_TEXT} characters")
        if "|" in secret:
            raise ValueError("a PayPal webhook id holds no '|'")

    def check_config(self, config: Config) -> None:
        check_settings(self.settings, config)
        for name in ("certificates", "trust_anchors"):
            if config.settings.get(name):
                try:
                    load_certificates(config.settings[name])
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return json_text(body, "id")

    def new_event_id(self) -> str:
        return f"WH-{random.token_hex(8).upper()}-{random.token_hex(8).upper()}"

    def fetcher(self, headers: Mapping[str, str], config: Config) -> Callable[[float], None] | None:
        url = headers.get("paypal-cert-url", "")
        if config.settings.get("certificates") or not url or self.cache.get(url) is not None:
            return None
        check_cert_url(url)  # before any request is made

        def fetch(timeout: float) -> None:
            cache = self.cache
            with cache.fetch_lock(url):
                if cache.get(url) is not None:
                    return
                if cache.failed_recently(url):
                    raise GatewayUnavailable(f"{url}: failed less than {FAILED_TTL:g}s ago")
                if not cache.slots.acquire(blocking=False):
                    raise GatewayUnavailable(f"more than {MAX_FETCHES} certificate fetches at once")
                try:
                    fetch_once(timeout)
                except GatewayUnavailable:
                    cache.mark_failed(url)
                    raise
                finally:
                    cache.slots.release()

        def fetch_once(timeout: float) -> None:
            try:
                status, body = self.fetch(url, timeout)
            except httpx.HTTPError as exc:
                raise GatewayUnavailable(f"{url}: {exc.__class__.__name__}") from None
            if status != 200:
                raise GatewayUnavailable(f"{url}: {status}")
            try:
                certificates = list(x509.load_pem_x509_certificates(body))
            except ValueError:
                raise GatewayUnavailable(f"{url}: no PEM certificate") from None
            self.cache.put(url, certificates)

        return fetch

    def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        secrets: Sequence[str],
        *,
        now: float | None,
        tolerance: float | None = 300,
        config: Config = NO_CONFIG,
    ) -> None:
        values = [headers.get(name, "") for name in HEADERS]
        if not all(values):
            raise MalformedHeaders()
        transmission_id, transmission_time, signature, url, algorithm = values
        if algorithm != ALGORITHM:
            raise MalformedHeaders()
        sent_at = _transmission_time(transmission_time)
        check_tolerance(int(sent_at.timestamp()), now, tolerance)
        try:
            given = base64.b64decode(signature, validate=True)
        except (binascii.Error, ValueError):
            raise MalformedHeaders() from None
        check_cert_url(url)
        keys = self._keys(url, config, sent_at)
        crc = zlib.crc32(body)
        for webhook_id in secrets:
            if not isinstance(webhook_id, str) or not webhook_id:
                continue
            message = f"{transmission_id}|{transmission_time}|{webhook_id}|{crc}".encode()
            for key in keys:
                try:
                    key.verify(given, message, padding.PKCS1v15(), hashes.SHA256())
                except InvalidSignature:
                    continue
                return
        raise SignatureMismatch()

    def _keys(self, url: str, config: Config, at: datetime) -> list[rsa.RSAPublicKey]:
        """The public keys that may have signed a transmission sent `at`."""
        pinned = config.settings.get("certificates")
        if pinned:
            candidates = [c for c in load_certificates(pinned) if _valid_at(c, at)]
        else:
            fetched = self.cache.get(url)
            if fetched is None:
                raise GatewayUnavailable(f"{url}: not fetched")
            anchors = load_certificates(config.settings.get("trust_anchors") or _DEFAULT_ANCHORS)
            candidates = [_checked_chain(fetched, anchors, at)]
        keys = [c.public_key() for c in candidates]
        rsa_keys = [k for k in keys if isinstance(k, rsa.RSAPublicKey)]
        if not rsa_keys:
            raise UntrustedCertificate()
        return rsa_keys

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        data = load_json_object(body)
        event_id = require_str(data, "id")
        event_type = require_str(data, "event_type")
        assert event_id is not None and event_type is not None
        digest = canonical_digest(data)
        occurred_at = iso_time(data.get("create_time"))
        resource = data.get("resource")
        resource = resource if isinstance(resource, dict) else {}
        kind = TYPES.get(event_type)
        if kind is None:
            object_id = resource.get("id")
            meaning = object_meaning(event_type, object_id)
            return Event.ignored(event_id, event_type, occurred_at, digest, meaning=meaning)
        if occurred_at is None:
            raise MalformedEvent("create_time", "expected an ISO 8601 time")
        if kind == "disputed":
            transactions = resource.get("disputed_transactions")
            first = transactions[0] if isinstance(transactions, list) and transactions else None
            if not isinstance(first, dict):
                raise MalformedEvent("resource.disputed_transactions", "expected a transaction")
            order_id = require_str(first, "seller_transaction_id")
            reference = require_str(first, "custom", optional=True, limit=MAX_REFERENCE)
            amount_key = "dispute_amount"
        else:
            order_id = (
                _capture_of_refund(resource) if kind == "refunded" else require_str(resource, "id")
            )
            reference = require_str(resource, "custom_id", optional=True, limit=MAX_REFERENCE)
            amount_key = "amount"
        amount = resource.get(amount_key)
        if not isinstance(amount, dict):
            raise MalformedEvent(f"resource.{amount_key}", "expected an object")
        currency = require_currency(amount, "currency_code")
        value = amount.get("value")
        try:
            minor = money.minor_units(value if isinstance(value, str) else "", currency)
        except ValueError as exc:
            raise MalformedEvent(f"resource.{amount_key}.value", str(exc)) from None
        event = Event(
            event_id=event_id,
            event_type=event_type,
            kind=kind,
            occurred_at=occurred_at,
            gateway_order_id=order_id,
            merchant_reference=reference,
            amount_minor=minor,
            currency=currency,
            digest=digest,
        )
        return dataclasses.replace(event, meaning=meaning_digest(event, resource.get("status")))

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        """An event as PayPal posts it, signed with the private key given
        as the `signing_key` credential (PEM) under the certificate URL of
        the `cert_url` setting, as only PayPal, or a test, can."""
        sample = one_event(samples)
        pem = config.credentials.get("signing_key")
        url = config.settings.get("cert_url")
        if not pem or not url:
            raise ValueError(
                "signing as PayPal takes --credential signing_key=@KEY.pem "
                "and --setting cert_url=URL"
            )
        key = load_pem_private_key(pem.encode(), password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("signing_key: expected an RSA private key")
        body = _sample_body(sample)
        transmission_id = str(uuid.uuid1())
        sent = datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        message = f"{transmission_id}|{sent}|{secret}|{zlib.crc32(body)}".encode()
        signature = key.sign(message, padding.PKCS1v15(), hashes.SHA256())
        return body, {
            "paypal-transmission-id": transmission_id,
            "paypal-transmission-time": sent,
            "paypal-transmission-sig": base64.b64encode(signature).decode(),
            "paypal-cert-url": url,
            "paypal-auth-algo": ALGORITHM,
            "paypal-auth-version": "v2",
        }


_DEFAULT_ANCHORS = default_trust_anchors()


def _checked_chain(
    certificates: list[x509.Certificate], anchors: Sequence[x509.Certificate], at: datetime
) -> x509.Certificate:
    """The leaf, if it chains to `anchors`, valid `at`, for a host under .paypal.com."""
    if not certificates or not anchors:
        raise UntrustedCertificate()
    leaf, intermediates = certificates[0], certificates[1:]
    names = [
        a.value
        for a in leaf.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        if isinstance(a.value, str)
    ]
    if len(names) != 1 or not names[0].endswith(CERT_HOST_SUFFIX):
        raise UntrustedCertificate()
    verifier = (
        PolicyBuilder()
        .store(Store(list(anchors)))
        .time(at.astimezone(UTC).replace(tzinfo=None))
        .build_server_verifier(x509.DNSName(names[0]))
    )
    try:
        verifier.verify(leaf, intermediates)
    except VerificationError:
        raise UntrustedCertificate() from None
    return leaf


def _valid_at(certificate: x509.Certificate, at: datetime) -> bool:
    return certificate.not_valid_before_utc <= at <= certificate.not_valid_after_utc


def _transmission_time(value: str) -> datetime:
    moment = iso_time(value)
    if moment is None:
        raise MalformedHeaders()
    return moment


def _capture_of_refund(resource: Mapping[str, Any]) -> str:
    """The capture a refund refunds: its `up` link names it."""
    links = resource.get("links")
    for link in links if isinstance(links, list) else []:
        if isinstance(link, dict) and link.get("rel") == "up":
            href = link.get("href")
            path = urlsplit(href).path if isinstance(href, str) else ""
            capture = require_str({"capture": path.removeprefix(CAPTURE_LINK)}, "capture")
            if path.startswith(CAPTURE_LINK) and capture is not None:
                return capture
    raise MalformedEvent("resource.links", "expected an up link to the refunded capture")


def _sample_body(sample: Sample) -> bytes:
    currency = sample.currency.upper()
    amount = {"currency_code": currency, "value": money.decimal_string(sample.amount, currency)}
    created = datetime.fromtimestamp(sample.occurred_at, UTC).isoformat().replace("+00:00", "Z")
    reference = {"custom_id": sample.merchant_reference} if sample.merchant_reference else {}
    resource: dict[str, Any]
    if sample.event_type == "CUSTOMER.DISPUTE.CREATED":
        transaction: dict[str, Any] = {"seller_transaction_id": sample.gateway_order_id}
        if sample.merchant_reference:
            transaction["custom"] = sample.merchant_reference
        resource_type = "dispute"
        resource = {
            "dispute_id": "PP-D-" + sample.event_id[-12:],
            "disputed_transactions": [transaction],
            "dispute_amount": amount,
            "reason": "MERCHANDISE_OR_SERVICE_NOT_RECEIVED",
            "status": "OPEN",
        }
    elif sample.event_type == "PAYMENT.CAPTURE.REFUNDED":
        resource_type = "refund"
        resource = {
            "id": "R" + sample.event_id[-16:],
            "amount": amount,
            "status": "COMPLETED",
            **reference,
            "links": [
                {
                    "href": f"https://api.paypal.com{CAPTURE_LINK}{sample.gateway_order_id}",
                    "rel": "up",
                    "method": "GET",
                }
            ],
        }
    else:
        resource_type = "capture"
        status = "COMPLETED" if sample.event_type.endswith("COMPLETED") else "DECLINED"
        resource = {"id": sample.gateway_order_id, "amount": amount, "status": status, **reference}
    event = {
        "id": sample.event_id,
        "event_version": "1.0",
        "create_time": created,
        "resource_type": resource_type,
        "event_type": sample.event_type,
        "summary": f"{sample.event_type} sent by payhook",
        "resource": resource,
    }
    return json.dumps(event, separators=(",", ":")).encode()
