"""Whether PostgreSQL can store an event as it was read, decided in one place.

An authentic event reaches PostgreSQL as JSON, its id as part of a primary
key and its time as a `timestamptz`. Some of what a body may hold cannot be
stored that way: text and jsonb refuse NUL (`\\u0000`), UTF-8 cannot encode a
lone surrogate (`\\ud800`), an index row holds a few kilobytes, and a time
past the end of the calendar in UTC (`9999-12-31T23:59:59-14:00`) is stored
but cannot be read back. Such an event would fail on every attempt. Here it
is refused as malformed instead, naming the field and the reason but never
its content, so that it is recorded once, as a receipt and an exception.

Every event is stored under `storable_event_id`: its own id when that can be
stored as it is, else a digest of it, so that a redelivery still finds its
receipt. An event with no readable id is keyed by its body's digest
(`unreadable_event_id`), so that every delivery of it is one receipt too.
"""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import UTC, datetime, timedelta

from payhook.errors import MalformedEvent
from payhook.gateways.base import MAX_REFERENCE, MAX_TEXT, Event

#: Stored ids that are a digest of the gateway's id. No gateway id beginning
#: with a reserved prefix is stored as it is, so no two ids share a stored one.
HASHED_PREFIX = "sha256:"
#: Stored ids of events without a readable id: the digest of their body.
UNREADABLE_PREFIX = "unreadable:"
RESERVED_PREFIXES = (HASHED_PREFIX, UNREADABLE_PREFIX)
#: The type recorded for an event whose own type cannot be read or stored.
UNREADABLE_TYPE = "unreadable"
#: The text fields of an event that are stored, and the characters each may hold.
TEXT_FIELDS = {
    "event_id": MAX_TEXT,
    "event_type": MAX_TEXT,
    "gateway_order_id": MAX_TEXT,
    "merchant_reference": MAX_REFERENCE,
    "links_to": MAX_TEXT,
    "currency": MAX_TEXT,
}
#: How far ahead of our clock an event's time may be: gateways' clocks drift,
#: but an event dated later than this did not happen yet.
MAX_FUTURE = timedelta(days=1)
#: The earliest event time stored: a day after the calendar's first, so that
#: it reads back in any session time zone.
EARLIEST = datetime.min.replace(tzinfo=UTC) + timedelta(days=1)


def storable_event(event: Event, now: datetime | None = None) -> Event:
    """`event` as it is stored: under `storable_event_id`, its time in UTC.

    `MalformedEvent` naming the field and the reason if a text field cannot
    be stored, or its time is not within the calendar and at most
    `MAX_FUTURE` past `now`.
    """
    for name, limit in TEXT_FIELDS.items():
        value = getattr(event, name)
        problem = None if value is None else text_problem(value, limit)
        if problem is not None:
            raise MalformedEvent(name, problem)
    occurred_at = event.occurred_at
    if occurred_at is not None:
        occurred_at = _storable_time(occurred_at, now or datetime.now(UTC))
    return dataclasses.replace(
        event, event_id=storable_event_id(event.event_id), occurred_at=occurred_at
    )


def recorded_identity(event: Event) -> Event:
    """What is recorded of an event `storable_event` refused: its identity and
    digest, as for a body that could not be read."""
    return Event.unreadable(
        storable_event_id(event.event_id), storable_type(event.event_type), event.digest
    )


def storable_event_id(raw: str) -> str:
    """The id an event is stored under: `raw` when it can be stored as it is
    and begins with no reserved prefix, else `sha256:` and the hex digest of
    its UTF-8 bytes (a lone surrogate as its own code, as `canonical_digest`
    does). The same gateway id always gives the same stored one, and two
    different ones never do."""
    if text_problem(raw) is None and not raw.startswith(RESERVED_PREFIXES):
        return raw
    return HASHED_PREFIX + hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()


def unreadable_event_id(digest: str) -> str:
    """The id of an authentic event with no readable id of its own, from its
    gateway's `unreadable_digest`: the same for every delivery of it."""
    return UNREADABLE_PREFIX + digest


def storable_type(value: object) -> str:
    """The type recorded for an event that cannot be read: the gateway's own
    when it is text that can be stored, else `unreadable`."""
    if isinstance(value, str) and value and text_problem(value) is None:
        return value
    return UNREADABLE_TYPE


def text_problem(value: str, limit: int = MAX_TEXT) -> str | None:
    """Why `value` cannot be stored as text as it is, at most `limit`
    characters; None if it can."""
    if len(value) > limit:
        return f"longer than {limit} characters"
    return character_problem(value)


def character_problem(value: str) -> str | None:
    """Why PostgreSQL cannot hold `value` as text at any length; None if it can."""
    if "\x00" in value:
        return "contains NUL"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate"
    return None


def _storable_time(value: datetime, now: datetime) -> datetime:
    if value.utcoffset() is None:
        raise MalformedEvent("occurred_at", "has no UTC offset")
    try:
        # In UTC: PostgreSQL reads no offset finer than a second, Python writes one.
        utc = value.astimezone(UTC)
    except OverflowError:
        raise MalformedEvent("occurred_at", "outside the calendar in UTC") from None
    if utc < EARLIEST:
        raise MalformedEvent("occurred_at", "outside the calendar in UTC")
    if utc > now + MAX_FUTURE:
        raise MalformedEvent("occurred_at", "more than a day in the future")
    return utc
