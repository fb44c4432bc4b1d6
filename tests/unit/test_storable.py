"""What PostgreSQL can store of an event: payhook.gateways.storable."""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from payhook.errors import MalformedEvent
from payhook.gateways import Event
from payhook.gateways.storable import (
    HASHED_PREFIX,
    MAX_FUTURE,
    recorded_identity,
    storable_event,
    storable_event_id,
    storable_type,
    unreadable_event_id,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
PAYMENT = Event(
    event_id="evt_1",
    event_type="payment_intent.succeeded",
    kind="succeeded",
    occurred_at=NOW,
    gateway_order_id="pi_1",
    merchant_reference="order-1",
    amount_minor=1999,
    currency="EUR",
    digest="a" * 64,
)


@pytest.mark.parametrize("raw", ["evt_1", "msg_2Lh", "x" * 255, "ünïcödé", "evt:sha256:1"])
def test_an_id_that_can_be_stored_is_stored_as_it_is(raw: str) -> None:
    assert storable_event_id(raw) == raw


@pytest.mark.parametrize(
    "raw",
    ["x" * 256, "evt_\x00", "evt_\ud800", "sha256:" + "0" * 64, "unreadable:" + "0" * 64],
    ids=["long", "nul", "surrogate", "hashed-prefix", "unreadable-prefix"],
)
def test_any_other_id_is_stored_as_a_digest_of_it(raw: str) -> None:
    stored = storable_event_id(raw)
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()
    assert stored == f"{HASHED_PREFIX}{digest}"
    assert storable_event_id(raw) == stored, "a redelivery finds the same receipt"


def test_no_two_ids_share_a_stored_one() -> None:
    """An id that looks like a stored digest is hashed itself; a surrogate
    pair written as two escapes is not the character it would encode."""
    long_id = "x" * 300
    hashed = storable_event_id(long_id)
    ids = [long_id, hashed, "\ud83d\ude00", "\U0001f600", "a\x00", "a", unreadable_event_id("0")]
    stored = [storable_event_id(raw) for raw in ids]
    assert len(set(stored)) == len(ids)
    assert all(len(s) <= 255 for s in stored)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("event_id", "evt_\x00", "contains NUL"),
        ("event_type", "payment_intent.\ud800", "contains a lone surrogate"),
        ("gateway_order_id", "pi_\x00", "contains NUL"),
        ("merchant_reference", "r" * 501, "longer than 500 characters"),
        ("gateway_order_id", "p" * 256, "longer than 255 characters"),
        ("currency", "EU\ud800", "contains a lone surrogate"),
    ],
)
def test_a_text_field_that_cannot_be_stored_is_named_without_its_content(
    field: str, value: str, reason: str
) -> None:
    changes: dict[str, Any] = {field: value}  # a field named at run time
    event = dataclasses.replace(PAYMENT, **changes)
    with pytest.raises(MalformedEvent) as raised:
        storable_event(event, NOW)
    assert raised.value.detail == {"field": field, "reason": reason}
    assert value not in str(raised.value)


@pytest.mark.parametrize(
    ("occurred_at", "reason"),
    [
        (datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC), "more than a day in the future"),
        (NOW + MAX_FUTURE + timedelta(seconds=1), "more than a day in the future"),
        (
            datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-14))),
            "outside the calendar in UTC",
        ),
        (datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14))), "outside the calendar in UTC"),
        (datetime(1, 1, 1, 12, tzinfo=UTC), "outside the calendar in UTC"),
        (datetime(2026, 1, 1), "has no UTC offset"),
    ],
    ids=[
        "year-9999",
        "a-day-ahead",
        "past-year-9999-in-utc",
        "before-year-1-in-utc",
        "year-1",
        "naive",
    ],
)
def test_a_time_out_of_bounds_is_malformed(occurred_at: datetime, reason: str) -> None:
    with pytest.raises(MalformedEvent) as raised:
        storable_event(dataclasses.replace(PAYMENT, occurred_at=occurred_at), NOW)
    assert raised.value.detail == {"field": "occurred_at", "reason": reason}


def test_a_storable_event_is_stored_in_utc_under_its_stored_id() -> None:
    """PostgreSQL reads no UTC offset finer than a second; the instant is kept."""
    odd = timezone(timedelta(hours=5, minutes=30, seconds=15, microseconds=500_000))
    event = dataclasses.replace(
        PAYMENT, event_id="sha256:evt", occurred_at=(NOW - timedelta(days=1)).astimezone(odd)
    )
    stored = storable_event(event, NOW)
    assert stored.occurred_at == NOW - timedelta(days=1)
    assert stored.occurred_at is not None and stored.occurred_at.utcoffset() == timedelta(0)
    assert stored.event_id == storable_event_id("sha256:evt") != "sha256:evt"
    assert dataclasses.replace(stored, event_id=event.event_id, occurred_at=event.occurred_at) == (
        event
    )
    assert storable_event(dataclasses.replace(PAYMENT, occurred_at=None), NOW).occurred_at is None


def test_what_is_recorded_of_an_event_that_cannot_be_stored() -> None:
    event = dataclasses.replace(PAYMENT, event_id="evt_\x00", event_type="odd\x00")
    recorded = recorded_identity(event)
    assert recorded == Event.unreadable(storable_event_id("evt_\x00"), "unreadable", "a" * 64)
    assert recorded_identity(PAYMENT).event_type == PAYMENT.event_type


@pytest.mark.parametrize("value", [None, 5, "", "t\x00", "t\ud800", "t" * 256])
def test_a_type_that_cannot_be_stored_is_recorded_as_unreadable(value: object) -> None:
    assert storable_type(value) == "unreadable"
