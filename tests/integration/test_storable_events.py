"""Authentic events PostgreSQL cannot store as they were read, through a real consumer.

Each is recorded on its first attempt as one `malformed` receipt with one
exception naming the field and the reason; a redelivery is a duplicate. No
text of the body reaches the receipt, the exception, the logs or RQ's record
of the job, and `payhook trace` finds it by the gateway's id.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import secrets
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from redis import Redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from structlog.testing import capture_logs

from consumer import handler
from consumer.applier import Applier
from consumer.handler import Runtime
from consumer.main import build_worker
from control import operations
from payhook.envelope import Envelope
from payhook.gateways import storable
from payhook.gateways.storable import storable_event_id
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.factories import Factory, Shop, StandardEvent, envelope, stripe_body, stripe_headers

#: Text of the body that must never be written anywhere but the body.
MARK = "card-4242-never-logged"
#: 10000-01-01T00:00:00Z as a Unix time.
YEAR_10000 = 253402300800
#: 3000-01-01T00:00:00Z as a Unix time.
YEAR_3000 = 32503680000


def apply_now(runtime: Runtime, envelope: Any) -> dict[str, Any]:
    """A job as a worker runs it when it began nothing: applied on this thread."""
    applier = Applier(runtime)
    try:
        return applier.finish(envelope)
    finally:
        applier.close()


@dataclass(frozen=True)
class Hostile:
    """An event whose JSON `change` makes it unstorable as it is, and what the
    exception must say of it."""

    gateway: str
    change: Callable[[dict[str, Any]], None]
    field: str
    reason: str


def _set(*path: str, value: object) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value

    return change


HOSTILE = {
    "standard-nul-in-reference": Hostile(
        "standard",
        _set("data", "merchant_reference", value=f"{MARK}\x00"),
        "merchant_reference",
        "contains NUL",
    ),
    "standard-surrogate-in-order-id": Hostile(
        "standard",
        _set("data", "gateway_order_id", value=f"{MARK}\ud800"),
        "gateway_order_id",
        "contains a lone surrogate",
    ),
    "standard-year-9999": Hostile(
        "standard",
        _set("timestamp", value="9999-12-31T23:59:59Z"),
        "occurred_at",
        "more than a day in the future",
    ),
    "standard-year-10000-in-utc": Hostile(
        "standard",
        _set("timestamp", value="9999-12-31T23:59:59-14:00"),
        "occurred_at",
        "outside the calendar in UTC",
    ),
    "stripe-nul-in-id": Hostile(
        "stripe", _set("id", value=f"evt_{MARK}\x00"), "event_id", "contains NUL"
    ),
    "stripe-3000-char-id": Hostile(
        "stripe",
        _set("id", value=f"evt_{MARK}{secrets.token_urlsafe(2250)}"),
        "id",
        "longer than 255 characters",
    ),
    "stripe-surrogate-in-ignored-type": Hostile(
        "stripe", _set("type", value=f"{MARK}\ud800"), "event_type", "contains a lone surrogate"
    ),
    "stripe-year-3000": Hostile(
        "stripe", _set("created", value=YEAR_3000), "occurred_at", "more than a day in the future"
    ),
    "stripe-year-10000": Hostile(
        "stripe", _set("created", value=YEAR_10000), "created", "expected a Unix time in seconds"
    ),
}


def deliveries(shop: Shop, hostile: Hostile) -> tuple[str, list[Envelope]]:
    """The event's id as the gateway sent it, and two deliveries of it (Stripe
    rewrites its delivery fields between them)."""
    if hostile.gateway == "standard":
        event = StandardEvent(merchant_reference=MARK)
        payload = json.loads(event.body())
        hostile.change(payload)
        body = json.dumps(payload).encode()
        headers = event.headers(shop.secret, body)
        return event.event_id, [envelope(shop, body, headers) for _ in range(2)]
    first = json.loads(stripe_body(order_ref=MARK, pending_webhooks=2))
    hostile.change(first)
    second = copy.deepcopy(first) | {"pending_webhooks": 1, "request": {"id": "req_again"}}
    bodies = [json.dumps(data).encode() for data in (first, second)]
    return first["id"], [envelope(shop, b, stripe_headers(shop.secret, b)) for b in bodies]


def run_worker(
    settings: Settings, runtime: Runtime, redis_conn: Redis, envelopes: list[Envelope]
) -> list[Job]:
    """Each envelope as a job, run by a real consumer worker; the jobs after."""
    queue = events_queue(redis_conn, settings)
    queued = [enqueue_event(queue, e, settings) for e in envelopes]
    build_worker(settings, runtime).work(burst=True, logging_level="ERROR")
    return [Job.fetch(j.id, connection=redis_conn, serializer=JSONSerializer) for j in queued]


def stored_text(factory: Factory) -> str:
    """Every receipt, exception and anomaly row, as text."""
    rows = []
    for table in ("payment_event_receipts", "payment_exceptions", "security_anomalies"):
        rows += factory.conn.execute(f"SELECT * FROM payhook.{table}").fetchall()
    return json.dumps(rows, default=str)


@pytest.mark.parametrize("hostile", HOSTILE.values(), ids=HOSTILE.keys())
def test_an_event_that_cannot_be_stored_as_it_is_is_one_malformed_receipt(
    settings: Settings,
    redis_conn: Redis,
    factory: Factory,
    runtime: Runtime,
    caplog: pytest.LogCaptureFixture,
    hostile: Hostile,
) -> None:
    shop = factory.shop(hostile.gateway)
    order_id = factory.order(shop, merchant_reference=MARK)
    gateway_id, envelopes = deliveries(shop, hostile)

    with capture_logs() as logs, caplog.at_level(logging.DEBUG):
        done = run_worker(settings, runtime, redis_conn, envelopes)

    assert [job.get_status() for job in done] == [JobStatus.FINISHED] * 2
    assert [job.return_value() for job in done] == [
        {"outcome": outcome, "order_id": None, "retries": 0}
        for outcome in ("malformed", "duplicate")
    ]
    receipts = factory.conn.execute(
        "SELECT event_id, outcome FROM payhook.payment_event_receipts"
    ).fetchall()
    assert receipts == [{"event_id": storable_event_id(gateway_id), "outcome": "malformed"}]
    exceptions = factory.conn.execute(
        "SELECT kind, detail FROM payhook.payment_exceptions"
    ).fetchall()
    assert exceptions == [
        {"kind": "malformed", "detail": {"field": hostile.field, "reason": hostile.reason}}
    ]
    assert factory.count("security_anomalies") == 0
    assert factory.order_state(shop, order_id) == "pending"
    assert factory.count("payment_order_transitions") == 0

    assert MARK not in stored_text(factory)
    assert MARK not in json.dumps(logs, default=repr)
    assert MARK not in caplog.text
    assert {"field": hostile.field, "reason": hostile.reason}.items() <= next(
        line for line in logs if line["event"] == "event_malformed"
    ).items()

    trace = operations.trace_event(factory.conn, shop.tenant_id, gateway_id)
    text = operations.format_trace(trace)
    assert trace.found and "outcome=malformed" in text
    assert f'"field": "{hostile.field}"' in text and MARK not in text


@pytest.mark.parametrize(
    "body",
    [
        b'{"type": "payment_intent.succeeded", "data": "' + MARK.encode() + b'"}',
        b"\xff" + MARK.encode(),
    ],
    ids=["json-without-id", "not-utf8"],
)
def test_two_deliveries_of_a_body_without_a_readable_id_are_one_receipt(
    runtime: Runtime, factory: Factory, body: bytes
) -> None:
    """Keyed by the body's digest, not by the delivery: the gateway's retries
    of an event payhook cannot read do not each add a receipt."""
    shop = factory.shop("stripe")
    headers = stripe_headers(shop.secret, body)
    outcomes = [apply_now(runtime, envelope(shop, body, headers).to_json()) for _ in range(2)]
    assert [o["outcome"] for o in outcomes] == ["malformed", "duplicate"]
    receipts = factory.conn.execute(
        "SELECT event_id, event_type FROM payhook.payment_event_receipts"
    ).fetchall()
    assert len(receipts) == 1
    assert receipts[0]["event_id"].startswith("unreadable:")
    assert receipts[0]["event_type"] in ("payment_intent.succeeded", "unreadable")
    assert factory.count("payment_exceptions", kind="malformed") == 1
    assert MARK not in stored_text(factory)


def test_a_time_with_a_sub_second_utc_offset_is_applied(runtime: Runtime, factory: Factory) -> None:
    """Python reads an offset PostgreSQL does not: the event's time is stored in UTC."""
    shop = factory.shop()
    order_id = factory.order(shop)
    event = StandardEvent()
    payload = json.loads(event.body())
    odd = timezone(timedelta(hours=5, minutes=30, seconds=15, microseconds=500_000))
    payload["timestamp"] = datetime.now(UTC).astimezone(odd).isoformat()
    body = json.dumps(payload).encode()
    job = envelope(shop, body, event.headers(shop.secret, body))
    assert apply_now(runtime, job.to_json())["outcome"] == "applied"
    assert factory.order_state(shop, order_id) == "paid"


def test_an_event_dated_ahead_redelivered_once_its_time_came_is_a_duplicate(
    runtime: Runtime, factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded with the digest of its content, as it would be once storable:
    the redelivery is no digest conflict."""
    shop = factory.shop()
    order_id = factory.order(shop)
    ahead = datetime.now(UTC) + timedelta(days=2)
    event = StandardEvent(timestamp=int(ahead.timestamp()))
    assert apply_now(runtime, factory.standard_envelope(shop, event).to_json())["outcome"] == (
        "malformed"
    )
    later = ahead + timedelta(hours=1)
    monkeypatch.setattr(handler, "storable_event", lambda e: storable.storable_event(e, later))
    assert apply_now(runtime, factory.standard_envelope(shop, event).to_json())["outcome"] == (
        "duplicate"
    )
    assert factory.count("security_anomalies") == 0
    assert factory.order_state(shop, order_id) == "pending"


def fail_receipts(factory: Factory, sqlstate: str) -> None:
    """Make every receipt insert fail with `sqlstate` and an error quoting the
    event's type, as PostgreSQL's own errors quote the JSON they could not read."""
    factory.conn.execute(
        f"""
        CREATE FUNCTION payhook.quote_and_fail() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION USING ERRCODE = '{sqlstate}', MESSAGE = 'refused ' || NEW.event_type,
                DETAIL = NEW.event_type;
        END;
        $$;
        CREATE TRIGGER quote_and_fail BEFORE INSERT ON payhook.payment_event_receipts
            FOR EACH ROW EXECUTE FUNCTION payhook.quote_and_fail();
        """
    )


@pytest.mark.parametrize(
    ("sqlstate", "error"),
    [
        ("P0001", "DatabaseError: RaiseException, SQLSTATE P0001"),
        ("40001", "TooManyRetries: {attempts} attempts, last SQLSTATE 40001"),
    ],
    ids=["raised", "retried"],
)
def test_a_database_error_in_a_job_carries_no_text_of_the_event(
    settings: Settings,
    redis_conn: Redis,
    factory: Factory,
    runtime: Runtime,
    caplog: pytest.LogCaptureFixture,
    sqlstate: str,
    error: str,
) -> None:
    """What RQ keeps and logs of the failure names the error, not the event
    (a serialization failure is retried in the job first)."""
    fail_receipts(factory, sqlstate)
    error = error.format(attempts=settings.serialization_retries + 1)
    shop = factory.shop()
    job = factory.standard_envelope(shop, StandardEvent(type=f"customer.{MARK}"))

    with pytest.raises(Exception) as raised:
        apply_now(runtime, job.to_json())
    assert not isinstance(raised.value, psycopg.Error)
    failure = "".join(traceback.format_exception(raised.value))
    assert error in failure and MARK not in failure

    once = dataclasses.replace(settings, job_retry_intervals=(0,))
    with capture_logs() as logs, caplog.at_level(logging.DEBUG):
        (failed,) = run_worker(once, runtime, redis_conn, [job])
    assert failed.get_status() == JobStatus.FAILED
    result = failed.latest_result()
    assert result is not None and result.exc_string is not None
    assert error in result.exc_string and MARK not in result.exc_string
    assert MARK not in json.dumps(logs, default=repr)
    assert MARK not in caplog.text
