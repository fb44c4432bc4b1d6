"""Braintree webhook notifications.

A notification is a form POST of `bt_signature` and `bt_payload`, the
payload base64 of an XML document. The signature is
`{public key}|{hex HMAC-SHA1}`, keyed with the SHA-1 digest of the private
key, over the payload as sent (or with one newline added, as Braintree's
libraries accept); several pairs may be joined by `&`. The endpoint's secret
is the API key pair, `PUBLIC_KEY:PRIVATE_KEY`: a rotation adds the new pair.

Only the signature is checked on the request path; the XML is decoded by
the consumer. Braintree's notifications have no id: payhook keys each by
`{kind}:{timestamp}:{subject id}`, which a retry of it repeats.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import hmac
import re
import secrets as random
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from urllib.parse import unquote_plus, unquote_to_bytes, urlencode
from xml.etree import ElementTree

from payhook import money
from payhook.errors import MalformedEvent, MalformedHeaders, SignatureMismatch
from payhook.gateways.base import (
    DAY,
    MAX_REFERENCE,
    MAX_TEXT,
    NO_CONFIG,
    Config,
    Event,
    GatewayBase,
    Sample,
    check_printable,
    iso_time,
    meaning_digest,
    object_meaning,
    one_event,
    raw_digest,
    require_currency,
    require_str,
)

#: Notification kinds payhook acts on; a settled credit is a refund.
TYPES = {
    "transaction_settled": "succeeded",
    "transaction_settlement_declined": "failed",
    "dispute_opened": "disputed",
}
#: What a payload may hold: base64 and the newlines Braintree's encoder adds.
PAYLOAD = re.compile(rb"[A-Za-z0-9+=/\n]+")
#: Characters of a payload: its XML is a few kilobytes.
MAX_PAYLOAD = 64 * 1024


def sign(secret: str, payload: bytes) -> str:
    """`bt_signature` of `payload` under the key pair `secret`."""
    public, private = key_pair(secret)
    key = hashlib.sha1(private.encode()).digest()
    return f"{public}|{hmac.new(key, payload, hashlib.sha1).hexdigest()}"


def key_pair(secret: str) -> tuple[str, str]:
    public, sep, private = secret.partition(":")
    if not sep or not public or not private or "|" in public or "&" in public:
        raise ValueError("a Braintree secret is the API key pair, PUBLIC_KEY:PRIVATE_KEY")
    return public, private


#: The escapes a form-encoded base64 payload holds, and what they stand for.
ESCAPES = ((b"%2B", b"+"), (b"%2F", b"/"), (b"%3D", b"="), (b"%0A", b"\n"))


def _form(body: bytes) -> tuple[str, bytes]:
    """`bt_signature` and `bt_payload` of a form body; `MalformedHeaders` if not one."""
    fields: dict[bytes, bytes] = {}
    for item in body.split(b"&", 8):
        name, sep, value = item.partition(b"=")
        if not sep or name in fields or name not in (b"bt_signature", b"bt_payload"):
            raise MalformedHeaders()
        fields[name] = value
    if len(fields) != 2:
        raise MalformedHeaders()
    try:
        signature = unquote_plus(fields[b"bt_signature"].decode("ascii"), errors="strict")
    except UnicodeDecodeError:
        raise MalformedHeaders() from None
    return signature, _unescape(fields[b"bt_payload"])


def _unescape(value: bytes) -> bytes:
    """A form-encoded payload's bytes. Base64 needs only four escapes, undone
    with `bytes.replace` (the general decoder takes tens of microseconds for a
    payload full of them); anything else goes to the general decoder."""
    if b"+" in value:  # a space, which base64 never holds
        return unquote_to_bytes(value.replace(b"+", b" "))
    decoded = value
    for escape, byte in ESCAPES:
        decoded = decoded.replace(escape, byte).replace(escape.lower(), byte)
    return unquote_to_bytes(value) if b"%" in decoded else decoded


@functools.lru_cache(maxsize=64)
def _hmac_key(private: str) -> bytes:
    return hashlib.sha1(private.encode()).digest()


class BraintreeGateway(GatewayBase):
    name = "braintree"
    #: The signature is in the body.
    signature_headers: tuple[str, ...] = ()
    #: Braintree signs no timestamp (the XML's is read by the consumer).
    tolerance: float | None = None
    #: Braintree retries for up to 24 hours.
    redelivery_window: float = 7 * DAY
    sample_type = "transaction_settled"

    def generate_secret(self) -> str:
        """Braintree makes API keys in its Control Panel; a pair made here is
        for tests and `payhook send`."""
        return f"{random.token_hex(8)}:{random.token_hex(16)}"

    def check_secret(self, secret: str) -> None:
        key_pair(secret)
        check_printable(secret, "a Braintree key pair")

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return None  # in the XML, which the consumer decodes

    def new_event_id(self) -> str:
        return random.token_hex(4)

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
        signature, payload = _form(body)
        if len(payload) > MAX_PAYLOAD or not PAYLOAD.fullmatch(payload):
            raise SignatureMismatch()
        pairs = [p.split("|", 1) for p in signature.split("&") if "|" in p][:16]
        found = False
        for secret in secrets:
            try:
                public, private = key_pair(secret)
            except (TypeError, ValueError):
                continue
            key = _hmac_key(private)
            for given_public, given in pairs:
                if given_public != public:
                    continue
                got = given.encode("ascii", "replace")
                # As sent; failing that, as Braintree's libraries also sign
                # it, with a last newline (which a form may have lost).
                for content in (payload, payload + b"\n"):
                    expected = hmac.new(key, content, hashlib.sha1).hexdigest().encode()
                    if hmac.compare_digest(expected, got):
                        found = True
                        break
        if not found:
            raise SignatureMismatch()

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        _, payload = _form_or_malformed(body)
        try:
            xml = base64.b64decode(payload.replace(b"\n", b""), validate=True)
            root = ElementTree.fromstring(xml)
        except (binascii.Error, ValueError, ElementTree.ParseError):
            raise MalformedEvent("bt_payload", "not base64 of an XML notification") from None
        kind = _text(root, "kind")
        stamp = _text(root, "timestamp")
        if kind is None or stamp is None:
            raise MalformedEvent("bt_payload", "expected a kind and a timestamp")
        subject = root.find("subject")
        if subject is None or len(subject) == 0:
            raise MalformedEvent("subject", "expected a transaction or a dispute")
        entity = subject[0]
        subject_id = _text(entity, "id") or ""
        event_id = f"{kind}:{stamp}:{subject_id}"
        occurred_at = iso_time(stamp)
        # A retry repeats the document: its digest is its bytes'.
        digest = raw_digest(xml)
        transaction = entity if entity.tag == "transaction" else entity.find("transaction")
        is_credit = transaction is not None and _text(transaction, "type") == "credit"
        event_kind = TYPES.get(kind)
        if kind == "transaction_settled" and is_credit:
            event_kind = "refunded"
        if event_kind is None or transaction is None:
            meaning = object_meaning(kind, subject_id)
            return Event.ignored(event_id[:MAX_TEXT], kind, occurred_at, digest, meaning=meaning)
        if occurred_at is None:
            raise MalformedEvent("timestamp", "expected an ISO 8601 time")
        values = {
            "order": _text(transaction, "refunded-transaction-id" if is_credit else "id"),
            "reference": _text(transaction, "order-id"),
            "currency": _text(entity, "currency-iso-code")
            or _text(transaction, "currency-iso-code"),
        }
        amount_tag = "amount-disputed" if entity.tag == "dispute" else "amount"
        amount = _text(entity, amount_tag) or _text(entity, "amount")
        currency = require_currency(values, "currency")
        try:
            minor = money.minor_units(amount or "", currency)
        except ValueError as exc:
            raise MalformedEvent(amount_tag, str(exc)) from None
        event = Event(
            event_id=event_id,
            event_type=kind,
            kind=event_kind,
            occurred_at=occurred_at,
            gateway_order_id=require_str(values, "order"),
            merchant_reference=require_str(values, "reference", optional=True, limit=MAX_REFERENCE),
            amount_minor=minor,
            currency=currency,
            digest=digest,
        )
        status = _text(entity, "status")
        return dataclasses.replace(event, meaning=meaning_digest(event, status))

    def unreadable_digest(self, body: bytes) -> str:
        try:
            return raw_digest(_form(body)[1])
        except MalformedHeaders:
            return raw_digest(body)

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        """A notification as Braintree posts it. Types are kinds;
        `transaction_settled:credit` is a settled refund of the order's sale."""
        sample = one_event(samples)
        kind, _, variant = sample.event_type.partition(":")
        stamp = datetime.fromtimestamp(sample.occurred_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        amount = money.decimal_string(sample.amount, sample.currency)
        reference = (
            f"<order-id>{_escape(sample.merchant_reference)}</order-id>"
            if sample.merchant_reference
            else ""
        )
        if kind.startswith("dispute_"):
            subject = (
                f"<dispute><id>dp_{sample.event_id}</id><status>open</status>"
                f"<amount>{amount}</amount><amount-disputed>{amount}</amount-disputed>"
                f"<currency-iso-code>{sample.currency.upper()}</currency-iso-code>"
                f"<transaction><id>{_escape(sample.gateway_order_id)}</id>"
                f"<amount>{amount}</amount>{reference}</transaction></dispute>"
            )
        elif variant == "credit":
            subject = (
                f"<transaction><id>rf_{sample.event_id}</id><status>settled</status>"
                f"<type>credit</type><amount>{amount}</amount>"
                f"<currency-iso-code>{sample.currency.upper()}</currency-iso-code>"
                f"<refunded-transaction-id>{_escape(sample.gateway_order_id)}"
                f"</refunded-transaction-id>{reference}</transaction>"
            )
        else:
            status = "settled" if kind == "transaction_settled" else "settlement_declined"
            subject = (
                f"<transaction><id>{_escape(sample.gateway_order_id)}</id>"
                f"<status>{status}</status><type>sale</type><amount>{amount}</amount>"
                f"<currency-iso-code>{sample.currency.upper()}</currency-iso-code>"
                f"{reference}</transaction>"
            )
        xml = (
            f'<notification><timestamp type="datetime">{stamp}</timestamp>'
            f"<kind>{kind}</kind><subject>{subject}</subject></notification>"
        )
        payload = base64.encodebytes(xml.encode())
        body = urlencode({"bt_signature": sign(secret, payload), "bt_payload": payload.decode()})
        return body.encode(), {"content-type": "application/x-www-form-urlencoded"}


def _form_or_malformed(body: bytes) -> tuple[str, bytes]:
    try:
        return _form(body)
    except MalformedHeaders:
        raise MalformedEvent("body", "not a form of bt_signature and bt_payload") from None


def _text(element: ElementTree.Element, tag: str) -> str | None:
    found = element.find(tag)
    if found is None or found.text is None or found.get("nil") == "true":
        return None
    return found.text.strip() or None


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
