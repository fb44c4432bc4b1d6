"""Gateway adapters against signatures made by the gateways' own libraries."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime

import pytest
import standardwebhooks
import stripe

from payhook.errors import (
    MalformedEvent,
    MalformedHeaders,
    SignatureMismatch,
    TimestampOutOfTolerance,
)
from payhook.gateways import generate_secret, get_gateway
from payhook.gateways.base import MAX_SIGNATURE_HEADER
from payhook.gateways.standard import StandardGateway
from payhook.gateways.storable import storable_event
from payhook.gateways.stripe import StripeGateway
from tests.factories import StandardEvent, stripe_body

NOW = time.time()
NOW_DT = datetime.fromtimestamp(NOW, UTC)


@pytest.fixture(autouse=True)
def fresh_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOW is the time of each test, not of the import: the libraries check their own clock."""
    monkeypatch.setitem(globals(), "NOW", time.time())


PAYMENT = (
    b'{"type": "payment.succeeded", "timestamp": "2026-01-01T00:00:00Z",'
    b' "data": {"gateway_order_id": "g", %b}}'
)
#: A gateway timestamp without an offset, an epoch number, and others no parse can read.
UNREADABLE_TIMESTAMPS = ["2025-07-18T22:55:39", 1752879339, "yesterday", "", True, {"at": 1}]


def standardwebhooks_headers(secret: str, event_id: str, body: bytes, ts: int) -> dict[str, str]:
    signature = standardwebhooks.Webhook(secret).sign(
        event_id, datetime.fromtimestamp(ts, UTC), body.decode()
    )
    return {"webhook-id": event_id, "webhook-timestamp": str(ts), "webhook-signature": signature}


class TestStandard:
    gateway = StandardGateway()
    secret = generate_secret("standard")

    def test_accepts_signature_from_standardwebhooks_library(self) -> None:
        event = StandardEvent()
        body = event.body()
        headers = standardwebhooks_headers(self.secret, event.event_id, body, int(NOW))
        self.gateway.verify(headers, body, [self.secret], now=NOW, tolerance=300)
        # and the library accepts ours
        ours = event.headers(self.secret, body) | {"webhook-timestamp": str(int(NOW))}
        ours["webhook-signature"] = headers["webhook-signature"]
        standardwebhooks.Webhook(self.secret).verify(body, ours)

    def test_our_signature_verifies_in_standardwebhooks_library(self) -> None:
        event = StandardEvent(timestamp=int(time.time()))
        body = event.body()
        standardwebhooks.Webhook(self.secret).verify(body, event.headers(self.secret, body))

    @pytest.mark.parametrize("part", ["body", "timestamp", "event_id", "secret"])
    def test_tampering_is_rejected(self, part: str) -> None:
        event = StandardEvent(timestamp=int(NOW))
        body = event.body()
        headers = event.headers(self.secret, body)
        secrets = [self.secret]
        if part == "body":
            body = body.replace(b"1999", b"1")
        elif part == "timestamp":
            headers["webhook-timestamp"] = str(int(NOW) - 1)
        elif part == "event_id":
            headers["webhook-id"] = "msg_other"
        else:
            secrets = [generate_secret("standard")]
        with pytest.raises(SignatureMismatch):
            self.gateway.verify(headers, body, secrets, now=NOW, tolerance=300)

    def test_any_of_several_secrets_and_signatures_matches(self) -> None:
        old, new = generate_secret("standard"), self.secret
        event = StandardEvent(timestamp=int(NOW))
        body = event.body()
        headers = event.headers(old, body)
        headers["webhook-signature"] = (
            "v1a,ignored-scheme " + event.headers(new, body)["webhook-signature"]
        )
        self.gateway.verify(headers, body, [new, old], now=NOW, tolerance=300)

    def test_only_unknown_schemes_is_a_mismatch(self) -> None:
        event = StandardEvent(timestamp=int(NOW))
        body = event.body()
        headers = event.headers(self.secret, body)
        headers["webhook-signature"] = headers["webhook-signature"].replace("v1,", "v2,")
        with pytest.raises(SignatureMismatch):
            self.gateway.verify(headers, body, [self.secret], now=NOW, tolerance=300)

    @pytest.mark.parametrize("skew", [-301, 301])
    def test_timestamp_outside_tolerance(self, skew: int) -> None:
        event = StandardEvent(timestamp=int(NOW) + skew)
        body = event.body()
        with pytest.raises(TimestampOutOfTolerance):
            self.gateway.verify(
                event.headers(self.secret, body), body, [self.secret], now=NOW, tolerance=300
            )
        # the consumer ignores freshness
        self.gateway.verify(
            event.headers(self.secret, body), body, [self.secret], now=None, tolerance=None
        )

    @pytest.mark.parametrize(
        "headers",
        [
            {},
            {"webhook-id": "m", "webhook-timestamp": "1"},
            {"webhook-id": "m", "webhook-timestamp": "soon", "webhook-signature": "v1,x"},
            {"webhook-timestamp": "1", "webhook-signature": "v1,x"},
        ],
    )
    def test_missing_or_malformed_headers(self, headers: dict[str, str]) -> None:
        with pytest.raises(MalformedHeaders):
            self.gateway.verify(headers, b"{}", [self.secret], now=NOW, tolerance=300)

    def test_a_signature_header_over_the_limit_is_malformed_before_any_hmac(self) -> None:
        event = StandardEvent(timestamp=int(NOW))
        body = event.body()
        headers = event.headers(self.secret, body)
        # Entries are separated by whitespace: the valid one, padded to the limit.
        at_limit = headers["webhook-signature"].rjust(MAX_SIGNATURE_HEADER)
        self.gateway.verify(
            headers | {"webhook-signature": at_limit}, body, [self.secret], now=NOW, tolerance=300
        )
        with pytest.raises(MalformedHeaders):
            self.gateway.verify(
                headers | {"webhook-signature": " " + at_limit},
                body,
                [self.secret],
                now=NOW,
                tolerance=300,
            )

    def test_parse_normalizes_the_event(self) -> None:
        event = StandardEvent(type="payment.refunded", amount=500, currency="eur")
        body = event.body()
        parsed = self.gateway.parse(event.headers(self.secret, body), body)
        assert parsed.event_id == event.event_id
        assert (parsed.kind, parsed.amount_minor, parsed.currency) == ("refunded", 500, "EUR")
        assert (parsed.gateway_order_id, parsed.merchant_reference) == ("pi_1", "order-1")
        assert parsed.occurred_at == datetime.fromtimestamp(event.timestamp, UTC)
        assert len(parsed.digest) == 64

    def test_digest_is_canonical_json(self) -> None:
        event = StandardEvent()
        body = event.body()
        reordered = json.dumps(json.loads(body), sort_keys=True, indent=2).encode()
        headers = event.headers(self.secret, body)
        assert (
            self.gateway.parse(headers, body).digest
            == self.gateway.parse(headers, reordered).digest
        )
        changed = body.replace(b"1999", b"2000")
        assert (
            self.gateway.parse(headers, body).digest != self.gateway.parse(headers, changed).digest
        )

    def test_unknown_type_has_no_kind(self) -> None:
        event = StandardEvent(type="customer.created")
        body = event.body()
        assert self.gateway.parse(event.headers(self.secret, body), body).kind is None

    @pytest.mark.parametrize(
        "body",
        [
            b"not json",
            b"[]",
            b'{"type": "payment.succeeded", "timestamp": "2026-01-01T00:00:00Z"}',
            PAYMENT % b'"amount": "10", "currency": "EUR"',
            PAYMENT % b'"amount": true, "currency": "EUR"',
            PAYMENT % b'"amount": 1, "currency": "EURO"',
        ],
    )
    def test_malformed_bodies(self, body: bytes) -> None:
        with pytest.raises(MalformedEvent):
            self.gateway.parse({"webhook-id": "m"}, body)

    @pytest.mark.parametrize("timestamp", [None, *UNREADABLE_TIMESTAMPS])
    @pytest.mark.parametrize(
        "event_type",
        ["payment.succeeded", "payment.failed", "payment.refunded", "payment.disputed"],
    )
    def test_an_event_to_act_on_without_a_readable_timestamp_is_malformed(
        self, event_type: str, timestamp: object
    ) -> None:
        """The horizon guard judges an event by its timestamp: an event payhook
        would act on cannot go without one (None: the field is missing)."""
        payload = json.loads(StandardEvent(type=event_type).body())
        if timestamp is None:
            del payload["timestamp"]
        else:
            payload["timestamp"] = timestamp
        with pytest.raises(MalformedEvent, match=r"^timestamp: expected an ISO 8601 time"):
            self.gateway.parse({"webhook-id": "m"}, json.dumps(payload).encode())

    @pytest.mark.parametrize("timestamp", [None, *UNREADABLE_TIMESTAMPS])
    def test_a_type_payhook_ignores_needs_no_timestamp(self, timestamp: object) -> None:
        payload = json.loads(StandardEvent(type="customer.created").body())
        if timestamp is None:
            del payload["timestamp"]
        else:
            payload["timestamp"] = timestamp
        parsed = self.gateway.parse({"webhook-id": "m"}, json.dumps(payload).encode())
        assert (parsed.kind, parsed.occurred_at) == (None, None)

    @pytest.mark.parametrize(
        "timestamp",
        [
            "2026-01-01T00:00:00Z",
            "2026-01-01T00:00:00+00:00",
            "2026-01-01T01:00:00.000+01:00",
            "2026-01-01t00:00:00z",
        ],
    )
    def test_a_timestamp_with_its_offset_is_read_as_that_instant(self, timestamp: str) -> None:
        payload = json.loads(StandardEvent().body()) | {"timestamp": timestamp}
        parsed = self.gateway.parse({"webhook-id": "m"}, json.dumps(payload).encode())
        assert parsed.occurred_at == datetime(2026, 1, 1, tzinfo=UTC)


class TestStripe:
    gateway = StripeGateway()
    secret = generate_secret("stripe")

    def test_accepts_header_from_stripe_library(self) -> None:
        body = stripe_body()
        header = stripe.WebhookSignature.generate_signature_header(
            body.decode(), self.secret, timestamp=int(NOW)
        )
        # Stripe checks no timestamp given None, though its annotation says int.
        stripe.Webhook.construct_event(body.decode(), header, self.secret, tolerance=None)  # type: ignore[arg-type]
        self.gateway.verify(
            {"stripe-signature": header}, body, [self.secret], now=NOW, tolerance=300
        )

    def test_several_v1_signatures_and_unknown_schemes(self) -> None:
        body = stripe_body()
        other = generate_secret("stripe")
        good = stripe.WebhookSignature.generate_signature_header(
            body.decode(), self.secret, int(NOW)
        )
        bad = stripe.WebhookSignature.generate_signature_header(body.decode(), other, int(NOW))
        header = f"{bad},v0=deadbeef,v1={good.split('v1=')[1]}"
        self.gateway.verify(
            {"stripe-signature": header}, body, [self.secret], now=NOW, tolerance=300
        )

    def test_an_empty_secret_written_by_hand_never_verifies(self) -> None:
        """The commands refuse one; a row written otherwise must not turn an
        empty HMAC key, which anybody can sign with, into a valid secret."""
        body = stripe_body()
        forged = stripe.WebhookSignature.generate_signature_header(body.decode(), "", int(NOW))
        with pytest.raises(SignatureMismatch):
            self.gateway.verify(
                {"stripe-signature": forged}, body, ["", self.secret], now=NOW, tolerance=300
            )

    @pytest.mark.parametrize("part", ["body", "timestamp", "secret"])
    def test_tampering_is_rejected(self, part: str) -> None:
        body = stripe_body()
        header = stripe.WebhookSignature.generate_signature_header(
            body.decode(), self.secret, int(NOW)
        )
        secrets = [self.secret]
        if part == "body":
            body = body.replace(b"1999", b"1")
        elif part == "timestamp":
            header = header.replace(f"t={int(NOW)}", f"t={int(NOW) - 1}")
        else:
            secrets = [generate_secret("stripe")]
        with pytest.raises(SignatureMismatch):
            self.gateway.verify({"stripe-signature": header}, body, secrets, now=NOW, tolerance=300)

    def test_stale_timestamp(self) -> None:
        body = stripe_body()
        header = stripe.WebhookSignature.generate_signature_header(
            body.decode(), self.secret, int(NOW) - 301
        )
        with pytest.raises(TimestampOutOfTolerance):
            self.gateway.verify(
                {"stripe-signature": header}, body, [self.secret], now=NOW, tolerance=300
            )

    @pytest.mark.parametrize("header", ["", "v1=abc", "t=soon,v1=abc"])
    def test_malformed_header(self, header: str) -> None:
        with pytest.raises(MalformedHeaders):
            self.gateway.verify(
                {"stripe-signature": header}, b"{}", [self.secret], now=NOW, tolerance=300
            )

    def test_a_signature_header_over_the_limit_is_malformed_before_any_hmac(self) -> None:
        body = stripe_body()
        valid = stripe.WebhookSignature.generate_signature_header(
            body.decode(), self.secret, int(NOW)
        )
        at_limit = valid + ",v0=" + "0" * (MAX_SIGNATURE_HEADER - len(valid) - 4)
        assert len(at_limit) == MAX_SIGNATURE_HEADER
        self.gateway.verify(
            {"stripe-signature": at_limit}, body, [self.secret], now=NOW, tolerance=300
        )
        with pytest.raises(MalformedHeaders):
            self.gateway.verify(
                {"stripe-signature": at_limit + "0"}, body, [self.secret], now=NOW, tolerance=300
            )

    def test_digest_ignores_fields_stripe_rewrites(self) -> None:
        first = stripe_body(event_id="evt_1", pending_webhooks=3)
        again = json.loads(first)
        again["pending_webhooks"] = 1
        again["request"] = {"id": None, "idempotency_key": None}
        second = json.dumps(again).encode()
        assert self.gateway.parse({}, first).digest == self.gateway.parse({}, second).digest
        again["data"]["object"]["amount"] = 1
        assert (
            self.gateway.parse({}, first).digest
            != self.gateway.parse({}, json.dumps(again).encode()).digest
        )

    @pytest.mark.parametrize(
        ("event_type", "kind", "cumulative"),
        [
            ("payment_intent.succeeded", "succeeded", False),
            ("payment_intent.payment_failed", "failed", False),
            ("charge.refunded", "refunded", True),
            ("charge.dispute.created", "disputed", False),
        ],
    )
    def test_parse_maps_types(self, event_type: str, kind: str, cumulative: bool) -> None:
        event = self.gateway.parse({}, stripe_body(event_type, event_id="evt_9", amount=700))
        assert (event.event_id, event.kind, event.cumulative) == ("evt_9", kind, cumulative)
        assert (event.gateway_order_id, event.merchant_reference) == ("pi_1", "order-1")
        assert (event.amount_minor, event.currency) == (700, "EUR")

    @pytest.mark.parametrize("created", [None, "1752879339", 1752879339.5, True, 0, -1, 2**35])
    @pytest.mark.parametrize(
        "event_type",
        [
            "payment_intent.succeeded",
            "payment_intent.payment_failed",
            "charge.refunded",
            "charge.dispute.created",
        ],
    )
    def test_an_event_to_act_on_without_a_readable_created_is_malformed(
        self, event_type: str, created: object
    ) -> None:
        """As for Standard Webhooks: the horizon guard needs the event's time
        (None: the field is missing)."""
        event = json.loads(stripe_body(event_type))
        if created is None:
            del event["created"]
        else:
            event["created"] = created
        with pytest.raises(MalformedEvent, match=r"^created: expected a Unix time"):
            self.gateway.parse({}, json.dumps(event).encode())

    @pytest.mark.parametrize("created", [None, "1752879339", True])
    def test_a_type_payhook_ignores_needs_no_created(self, created: object) -> None:
        event = json.loads(stripe_body()) | {"type": "customer.updated"}
        if created is None:
            del event["created"]
        else:
            event["created"] = created
        parsed = self.gateway.parse({}, json.dumps(event).encode())
        assert (parsed.kind, parsed.occurred_at) == (None, None)

    def test_created_is_read_as_unix_seconds(self) -> None:
        event = json.loads(stripe_body()) | {"created": 1_767_225_600}
        parsed = self.gateway.parse({}, json.dumps(event).encode())
        assert parsed.occurred_at == datetime(2026, 1, 1, tzinfo=UTC)

    def test_a_payment_counts_what_was_captured_not_what_was_asked(self) -> None:
        """After a partial capture `amount_received` is less than `amount`:
        that is what was paid (and a failed attempt received nothing)."""
        partial = stripe_body(amount=1999, received=1000)
        assert self.gateway.parse({}, partial).amount_minor == 1000
        failed = stripe_body("payment_intent.payment_failed", amount=1999)
        assert self.gateway.parse({}, failed).amount_minor == 1999
        legacy = json.loads(stripe_body(amount=1999, received=1000))
        del legacy["data"]["object"]["amount_received"]
        assert self.gateway.parse({}, json.dumps(legacy).encode()).amount_minor == 1999

    def test_what_an_event_means_does_not_change_with_its_rendering(self) -> None:
        """Another API version renders other fields; the meaning is the type,
        identifiers, amount, currency and status."""
        first = json.loads(stripe_body(event_id="evt_m"))
        other = json.loads(json.dumps(first))
        other["api_version"] = "2020-08-27"
        other["data"]["object"] |= {"charges": {"object": "list", "data": []}, "review": None}
        parse = self.gateway.parse
        a, b = (parse({}, json.dumps(e).encode()) for e in (first, other))
        assert a.digest != b.digest
        assert a.meaning == b.meaning is not None
        for field, value in (("amount_received", 1), ("currency", "usd"), ("status", "canceled")):
            changed = json.loads(json.dumps(first))
            changed["data"]["object"][field] = value
            assert parse({}, json.dumps(changed).encode()).meaning != a.meaning, field
        ignored = first | {"type": "customer.updated"}
        ignored_other = other | {"type": "customer.updated"}
        assert (
            parse({}, json.dumps(ignored).encode()).meaning
            == parse({}, json.dumps(ignored_other).encode()).meaning
        )

    @pytest.mark.parametrize("shape", ["null", "absent"])
    def test_a_refund_of_a_charge_without_a_payment_intent_maps_by_the_charge(
        self, shape: str
    ) -> None:
        """Charges API, or an API version from before PaymentIntents."""
        event = json.loads(stripe_body("charge.refunded", payment_intent=None, charge="ch_9"))
        if shape == "absent":
            del event["data"]["object"]["payment_intent"]
        parsed = self.gateway.parse({}, json.dumps(event).encode())
        assert (parsed.kind, parsed.gateway_order_id, parsed.merchant_reference) == (
            "refunded",
            "ch_9",
            "order-1",
        )

    def test_a_dispute_without_a_payment_intent_maps_by_its_charge_and_reference(self) -> None:
        body = stripe_body("charge.dispute.created", payment_intent=None, charge="ch_9")
        parsed = self.gateway.parse({}, body)
        assert (parsed.kind, parsed.gateway_order_id, parsed.merchant_reference) == (
            "disputed",
            "ch_9",
            "order-1",
        )
        expanded = json.loads(body)
        expanded["data"]["object"]["charge"] = {"id": "ch_8", "object": "charge"}
        assert self.gateway.parse({}, json.dumps(expanded).encode()).gateway_order_id == "ch_8"

    def test_a_dispute_with_a_payment_intent_maps_by_it(self) -> None:
        parsed = self.gateway.parse({}, stripe_body("charge.dispute.created", charge="ch_9"))
        assert parsed.gateway_order_id == "pi_1"

    def test_an_order_reference_is_read_up_to_stripes_own_limit(self) -> None:
        """Stripe's metadata values hold up to 500 characters."""
        longest = "r" * 500
        parsed = self.gateway.parse({}, stripe_body(order_ref=longest))
        assert parsed.merchant_reference == longest
        assert storable_event(parsed, NOW_DT).merchant_reference == longest
        with pytest.raises(MalformedEvent, match="order_id: longer than 500 characters"):
            self.gateway.parse({}, stripe_body(order_ref=longest + "r"))

    def test_a_dispute_naming_neither_payment_intent_nor_charge_is_malformed(self) -> None:
        event = json.loads(stripe_body("charge.dispute.created", payment_intent=None))
        del event["data"]["object"]["charge"]
        with pytest.raises(MalformedEvent, match=r"^charge: expected a non-empty string"):
            self.gateway.parse({}, json.dumps(event).encode())


def test_unknown_gateway_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown gateway"):
        get_gateway("worldpay")


def test_deeply_nested_body_is_malformed_not_a_crash() -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(MalformedEvent):
        StandardGateway().parse({"webhook-id": "m"}, body)


def test_unreadable_bodies_are_digested_as_their_redeliveries_repeat_them() -> None:
    body = b'{"id": "evt_1", "type": "x", "pending_webhooks": 2, "request": {"id": "req_1"}}'
    again = b'{"id": "evt_1", "type": "x", "pending_webhooks": 1, "request": {"id": "req_2"}}'
    stripe_gateway, standard_gateway = get_gateway("stripe"), get_gateway("standard")
    assert stripe_gateway.unreadable_digest(body) == stripe_gateway.unreadable_digest(again)
    assert stripe_gateway.unreadable_digest(b"not json") == hashlib.sha256(b"not json").hexdigest()
    changed = body.replace(b'"type": "x"', b'"type": "y"')
    assert stripe_gateway.unreadable_digest(changed) != stripe_gateway.unreadable_digest(body)
    assert standard_gateway.unreadable_digest(body) == hashlib.sha256(body).hexdigest()


def test_bodies_json_reads_but_utf8_cannot_hold_are_digested_not_raised() -> None:
    """A lone surrogate escape, an integer beyond Python's digit limit, deep
    nesting: an authentic body may hold any of them; none may fail the job."""
    event = StandardEvent()
    odd = event.body().replace(b'"type":', b'"note": "\\ud800", "type":', 1)
    assert odd != event.body()
    parsed = get_gateway("standard").parse({"webhook-id": event.event_id}, odd)
    assert len(parsed.digest) == 64
    stripe_gateway = get_gateway("stripe")
    for body in (
        b'{"id": "evt_1", "type": 5, "x": "\\ud800"}',
        b'{"id": "evt_1", "n": ' + b"9" * 5000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
    ):
        with pytest.raises(MalformedEvent):
            stripe_gateway.parse({}, body)
        assert len(stripe_gateway.unreadable_digest(body)) == 64


@pytest.mark.parametrize("currency", ["u\u017fd", "\u0131so", "\u00df\u00df\u00df", "US1", "US"])
def test_a_currency_is_three_ascii_letters_before_it_is_upper_cased(currency: str) -> None:
    """`str.upper` turns U+017F (long s) into S and U+00DF into SS: "u\u017fd"
    must not become USD."""
    body = json.loads(stripe_body())
    body["data"]["object"]["currency"] = currency
    with pytest.raises(MalformedEvent, match="currency"):
        StripeGateway().parse({}, json.dumps(body).encode())
