"""What every gateway adapter provides, and the event shape they normalize to."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, NamedTuple, Protocol, runtime_checkable

from payhook.errors import (
    MalformedEvent,
    MalformedHeaders,
    SignatureMismatch,
    TimestampOutOfTolerance,
)

#: The event kinds payhook acts on; any other gateway type is recorded and ignored.
KINDS = ("succeeded", "failed", "refunded", "disputed")
#: Characters a signature header may hold. A signature takes about 50 (a
#: Standard Webhooks `v1,` and base64) to 70 (Stripe's `v1=` and hex), and a
#: sender signs with one secret, or a few while rotating: 4 KiB is room for
#: dozens. Longer is malformed (400) before any HMAC is computed: every entry
#: is compared with every secret, and an 8 MB header of empty entries held
#: the ingress's event loop for over half a second.
MAX_SIGNATURE_HEADER = 4096
#: Characters an identifier or type read from an event may hold: an index row
#: holds a few thousand bytes, and no gateway's identifiers come near this.
MAX_TEXT = 255
#: Characters a merchant reference may hold: Stripe's metadata values go up
#: to 500, and an order found by such a reference must be found by its event.
#: Still well within an index row (2,000 bytes of UTF-8 at most).
MAX_REFERENCE = 500
#: Seconds in a day, for the gateways' redelivery windows.
DAY = 86400.0


@dataclass(frozen=True)
class Event:
    """One gateway event in payhook's terms. Amounts are in minor units."""

    event_id: str
    #: The gateway's own type name, as recorded on the receipt.
    event_type: str
    #: One of KINDS, or None for a type payhook does not act on.
    kind: str | None
    #: When the gateway says the event happened. Never None for an event of
    #: one of KINDS: `parse` refuses such an event as malformed, since the
    #: retention horizon could not judge its age. Optional for other types.
    occurred_at: datetime | None
    gateway_order_id: str | None
    merchant_reference: str | None
    amount_minor: int | None
    currency: str | None
    #: sha256 of the canonical JSON of the business content.
    digest: str
    #: For refunds: True when amount_minor is the total refunded so far
    #: (Stripe's `amount_refunded`), False when it is this refund alone.
    cumulative: bool = False
    #: sha256 of what the event means (type, identifiers, amount, currency,
    #: status), however the gateway rendered it: a repeat of the identity is
    #: a conflict when this differs. None where `digest` already is that (a
    #: gateway that renders an event one way only, as Standard Webhooks) and
    #: for a body payhook cannot read: repeats are compared by `digest`.
    meaning: str | None = None
    #: For a gateway whose events only link to their object (GoCardless):
    #: that object's id, which `Gateway.complete` reads from the API before
    #: the transaction. Not stored: the completed event names its order.
    links_to: str | None = None

    def to_json(self) -> dict[str, Any]:
        """What the transaction stores and decides by (every field but `links_to`)."""
        # Field by field: `asdict` deep-copies every value, a tenth of a
        # consumer job's CPU for fields that are all strings and numbers.
        data = {name: getattr(self, name) for name in _STORED}
        data["occurred_at"] = self.occurred_at.isoformat() if self.occurred_at else None
        return data

    @classmethod
    def ignored(
        cls,
        event_id: str,
        event_type: str,
        occurred_at: datetime | None,
        digest: str,
        *,
        meaning: str | None = None,
    ) -> Event:
        """An event of a type payhook does not act on: recorded, nothing more."""
        return cls(
            event_id=event_id,
            event_type=event_type,
            kind=None,
            occurred_at=occurred_at,
            gateway_order_id=None,
            merchant_reference=None,
            amount_minor=None,
            currency=None,
            digest=digest,
            meaning=meaning,
        )

    @classmethod
    def unreadable(cls, event_id: str, event_type: str, digest: str) -> Event:
        """An authentic body payhook cannot read: an event that can only be recorded."""
        return cls(
            event_id=event_id,
            event_type=event_type,
            kind=None,
            occurred_at=None,
            gateway_order_id=None,
            merchant_reference=None,
            amount_minor=None,
            currency=None,
            digest=digest,
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Event:
        values = dict(data)
        if values.get("occurred_at"):
            values["occurred_at"] = datetime.fromisoformat(values["occurred_at"])
        return cls(**values)


_STORED = tuple(f.name for f in fields(Event) if f.name != "links_to")


@dataclass(frozen=True)
class Sample:
    """A test event to send as the gateway would (`payhook send`)."""

    event_id: str
    event_type: str
    gateway_order_id: str
    #: Minor units.
    amount: int
    currency: str
    merchant_reference: str | None
    #: When it happened, Unix seconds, as its body says.
    occurred_at: int
    #: The event id was given: every send of it must repeat the same body (a
    #: redelivery), so the objects it names get ids derived from it.
    repeated: bool = False


@dataclass(frozen=True)
class Setting:
    """A per-endpoint setting a gateway reads (`payhook endpoints add --setting`)."""

    #: What it is, for `payhook endpoints add --help` and errors.
    help: str
    #: Sealed at rest and never shown (a password, an API token): given with
    #: `--credential`, stored in the endpoint's `credentials`.
    credential: bool = False
    required: bool = False
    #: A credential `verify` reads (a basic-auth password): the ingress holds
    #: it. Others (API tokens) are opened by the consumers only.
    verifies: bool = False


@dataclass(frozen=True)
class Config:
    """An endpoint's settings and opened credentials, as its gateway reads them."""

    settings: Mapping[str, str] = field(default_factory=dict)
    credentials: Mapping[str, str] = field(default_factory=dict, repr=False)


#: The configuration of an endpoint that has none.
NO_CONFIG = Config()


class Reply(NamedTuple):
    """An answer the gateway expects."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"


class Gateway(Protocol):
    """Verify a raw request against an endpoint's secrets; read its events.

    Everything payhook knows of a gateway is here, in its one module: adding
    a gateway is adding a module and naming it in `payhook.gateways.GATEWAYS`.
    `GatewayBase` gives what most gateways share; docs/gateways.md walks
    through the contract.
    """

    name: str
    #: Lower-case names of the headers that carry the signature.
    signature_headers: tuple[str, ...]
    #: Per-endpoint settings and credentials, by name.
    settings: Mapping[str, Setting]
    #: The status of the answer to a request that is not authentic.
    refused_status: int

    @property
    def tolerance(self) -> float | None:
        """Seconds a signed timestamp may differ from payhook's clock, either
        way; None for a gateway that signs no timestamp (a replay of its
        request is a duplicate, found by the event's key)."""

    #: Seconds after an event during which the gateway may still deliver it
    #: (`payhook.horizon`: receipts are kept longer than the longest).
    redelivery_window: float

    def generate_secret(self) -> str:
        """A fresh endpoint secret in the gateway's format."""

    def check_secret(self, secret: str) -> None:
        """`ValueError`, saying why, unless the gateway can sign with `secret`."""

    def check_config(self, config: Config) -> None:
        """`ValueError`, saying why, unless an endpoint can work with `config`."""

    def read_event_id(self, headers: Mapping[str, str], body: bytes) -> str | None:
        """The event id of an authentic request as the gateway sent it, for
        the ingress's log line, without parsing more; None if unreadable."""

    #: The event type `payhook send` sends when none is given.
    sample_type: str

    def new_event_id(self) -> str:
        """A fresh event id in the gateway's format."""

    def sample_request(
        self,
        samples: Sequence[Sample],
        secret: str,
        timestamp: int,
        config: Config = NO_CONFIG,
    ) -> tuple[bytes, dict[str, str]]:
        """The body and signed headers the gateway would send for `samples`
        (one, unless it batches), as configured at the gateway for an
        endpoint of `config`; `ValueError` if it cannot sign with `secret`."""

    def fetcher(self, headers: Mapping[str, str], config: Config) -> Callable[[float], None] | None:
        """None when `verify` has all it needs for this request; else a
        blocking function, given a timeout, that fetches what it lacks (a
        certificate) or raises `GatewayUnavailable` or `SignatureError`."""

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
        """Raise a `SignatureError` unless the request is authentic: all of
        it, every event of a batch.

        `tolerance=None` skips the freshness check (the consumer re-verifies a
        request the ingress already found fresh).
        """

    def split(self, body: bytes) -> list[bytes] | None:
        """None for a gateway that sends one event per request. Else the
        events of an authentic request, each as the body of its own job (and
        of `parse`); `MalformedEvent` if the request cannot be split, which
        is then recorded whole, as an unreadable event."""

    def parse(self, headers: Mapping[str, str], body: bytes) -> Event:
        """The normalized event of an authentic request, or of one part of a
        split one (then `headers` is empty); `MalformedEvent` if unreadable,
        or of one of KINDS without a readable gateway timestamp."""

    def complete(self, event: Event, config: Config, timeout: float) -> list[Event]:
        """For an event that links to its object (`links_to`): what the
        gateway's API says of that object, as the events it stands for, in
        the order they apply (its amount, its order; a payment's facts for a
        Mollie webhook). Each is applied in its own transaction.
        `GatewayUnavailable` when the API does not answer: the job is
        retried; an event is never applied unchecked."""

    def accepted(self, delivery_ids: Sequence[str]) -> Reply:
        """The answer once every event of the request is queued."""

    def unreadable_digest(self, body: bytes) -> str:
        """The digest of an authentic body `parse` refused, stable across the
        gateway's redeliveries of it, so that one is a duplicate, not a conflict."""


class Page(NamedTuple):
    """Events a gateway's API listed, newest first, and whether more follow."""

    events: list[dict[str, Any]]
    more: bool


@runtime_checkable
class EventSource(Protocol):
    """A gateway whose API lists its events (`payhook reconcile`)."""

    def list_events(
        self, config: Config, since: datetime, after: str | None, timeout: float
    ) -> Page:
        """The events created since `since`, newest first, after the event id
        `after` (the last of the previous page); `RateLimited` or
        `GatewayUnavailable` when the API does not answer them."""

    def event_id_of(self, event: Mapping[str, Any]) -> str:
        """The id an event listed by the API is received under."""

    def acts_on(self, event: Mapping[str, Any]) -> bool:
        """Whether payhook acts on an event of this type."""


class GatewayBase:
    """What most gateways share: no settings, 401 for a request that is not
    authentic, 202 with the delivery id once queued, one event per request,
    nothing to fetch, an unreadable body digested as its bytes."""

    settings: Mapping[str, Setting] = {}
    refused_status = 401

    def check_config(self, config: Config) -> None:
        check_settings(self.settings, config)

    def fetcher(self, headers: Mapping[str, str], config: Config) -> Callable[[float], None] | None:
        return None

    def split(self, body: bytes) -> list[bytes] | None:
        return None

    def complete(self, event: Event, config: Config, timeout: float) -> list[Event]:
        return [event]

    def unreadable_digest(self, body: bytes) -> str:
        """The exact bytes', which a redelivery repeats."""
        return raw_digest(body)

    def accepted(self, delivery_ids: Sequence[str]) -> Reply:
        if len(delivery_ids) == 1:
            return Reply(202, b'{"delivery_id": "%b"}' % delivery_ids[0].encode())
        return Reply(202, json.dumps({"delivery_ids": list(delivery_ids)}).encode())


def one_event(samples: Sequence[Sample]) -> Sample:
    """The one sample of a gateway that sends one event per request."""
    if len(samples) != 1:
        raise ValueError("this gateway sends one event per request")
    return samples[0]


class BodyHmacGateway(GatewayBase):
    """A gateway that signs the raw body alone: one header holding the hex
    HMAC-SHA256 of it (`hex_hmac_sha256`), keyed with the endpoint's secret;
    no timestamp is signed."""

    #: The header that carries the signature.
    hmac_header: str

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
        given = signature_header(headers, self.hmac_header)
        require_signature([given], secrets, lambda secret: hex_hmac_sha256(secret, body))


def check_settings(known: Mapping[str, Setting], config: Config) -> None:
    """`ValueError` for a setting or credential the gateway does not read, one
    given as the other, or a required one missing."""
    for name in config.settings:
        if name not in known:
            raise ValueError(f"unknown setting {name!r}; expected one of {sorted(known)}")
        if known[name].credential:
            raise ValueError(f"{name} is a credential: give it with --credential")
    for name in config.credentials:
        if name not in known:
            raise ValueError(f"unknown credential {name!r}; expected one of {sorted(known)}")
        if not known[name].credential:
            raise ValueError(f"{name} is a setting, not a credential: give it with --setting")
    for name, setting in known.items():
        given = config.credentials if setting.credential else config.settings
        if setting.required and not given.get(name):
            raise ValueError(f"{name} is required: {setting.help}")


def meaning_digest(event: Event, status: object = None) -> str:
    """The digest of what `event` means: its type, identifiers, amount and
    currency, and the status its gateway gives the object, if any."""
    return canonical_digest(
        {
            "event_type": event.event_type,
            "kind": event.kind,
            "gateway_order_id": event.gateway_order_id,
            "merchant_reference": event.merchant_reference,
            "amount_minor": event.amount_minor,
            "currency": event.currency,
            "status": status if isinstance(status, str) else None,
        }
    )


def object_meaning(event_type: str, object_id: object, status: object = None) -> str:
    """The meaning of an event payhook does not act on: its type, the id of
    the object it is about and, where the gateway gives one, its status."""
    content: dict[str, Any] = {
        "event_type": event_type,
        "object": object_id if isinstance(object_id, str) else None,
    }
    if status is not None:
        content["status"] = status if isinstance(status, str) else None
    return canonical_digest(content)


def signature_header(headers: Mapping[str, str], name: str) -> bytes:
    """A signature header's bytes as sent (headers arrive as Latin-1);
    `MalformedHeaders` when it is missing or over MAX_SIGNATURE_HEADER."""
    value = headers.get(name, "")
    if not value or len(value) > MAX_SIGNATURE_HEADER:
        raise MalformedHeaders()
    return value.encode("latin-1", "replace")


def check_printable(secret: str, what: str) -> None:
    """`ValueError` unless `secret` is printable ASCII, as gateways show them."""
    if not secret or not (secret.isascii() and secret.isprintable()):
        raise ValueError(f"{what} is printable ASCII")


def json_text(body: bytes, key: str) -> str | None:
    """`body`'s top-level string `key`, for the ingress's log line; None if
    the body is not a JSON object with one."""
    try:
        value = json.loads(body).get(key)
    except (ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, str) and value else None


def canonical_digest(content: Any) -> str:
    """sha256 hex of canonical JSON: sorted keys, no whitespace, UTF-8."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # JSON may escape a lone surrogate (`"\ud800"`), which UTF-8 cannot hold:
    # such a string is hashed as its surrogate code, rather than failing the event.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_tolerance(timestamp: int, now: float | None, tolerance: float | None) -> None:
    if tolerance is None:
        return
    if now is None:
        raise ValueError("now is required with a tolerance")
    if abs(now - timestamp) > tolerance:
        raise TimestampOutOfTolerance()


def hex_hmac_sha256(secret: str, content: bytes) -> str:
    """Hex HMAC-SHA256 of `content` keyed with `secret` as UTF-8: how
    GoCardless, Checkout.com and Razorpay sign a body."""
    return hmac.new(secret.encode(), content, hashlib.sha256).hexdigest()


def require_signature(
    given: Sequence[bytes], secrets: Sequence[str], sign: Callable[[str], str]
) -> None:
    """`SignatureMismatch` unless one of `given` is `sign(secret)` for one of
    `secrets` (an empty or NULL secret, written by hand, signs nothing)."""
    expected = [sign(s).encode() for s in secrets if isinstance(s, str) and s]
    if not any_signature_matches(expected, given):
        raise SignatureMismatch()


def same_bytes(expected: bytes, given: bytes) -> bool:
    """Whether a fixed credential (a password, a static header) was given, in
    constant time whatever the lengths: their digests are compared."""
    return hmac.compare_digest(hashlib.sha256(expected).digest(), hashlib.sha256(given).digest())


def any_signature_matches(expected: Sequence[bytes], given: Sequence[bytes]) -> bool:
    """Constant-time comparison of every given signature with every expected one."""
    found = False
    for want in expected:
        for got in given:
            # No short-circuit: every pair is compared.
            found |= hmac.compare_digest(want, got)
    return found


def iso_time(value: object) -> datetime | None:
    """An ISO 8601 time with its UTC offset (`Z` too), as most gateways write
    them; None for anything else."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


def raw_digest(body: bytes) -> str:
    """sha256 hex of the exact bytes."""
    return hashlib.sha256(body).hexdigest()


def load_json_object(body: bytes) -> dict[str, Any]:
    # ValueError: not UTF-8, not JSON, or an integer beyond Python's digit limit.
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise MalformedEvent("body", f"not JSON ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise MalformedEvent("body", "not a JSON object")
    return data


def require_str(
    data: Mapping[str, Any], key: str, *, optional: bool = False, limit: int = MAX_TEXT
) -> str | None:
    value = data.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise MalformedEvent(key, "expected a non-empty string")
    if len(value) > limit:
        raise MalformedEvent(key, f"longer than {limit} characters")
    return value


def require_amount(data: Mapping[str, Any], key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2**62:
        raise MalformedEvent(key, "expected a whole number of minor units")
    return value


def require_currency(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    # ASCII letters only: `str.upper` turns some other letters into ASCII ones
    # (U+017F, a long s, into S) or into two (U+00DF into SS).
    if not isinstance(value, str) or len(value) != 3 or not (value.isascii() and value.isalpha()):
        raise MalformedEvent(key, "expected a three-letter currency code")
    return value.upper()
