"""Settings, the named-query loader and the job envelope."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

import orjson
import pytest

from payhook.envelope import Envelope, MalformedJob, NewerEnvelope, part_proof, part_proven
from payhook.errors import QueryFileError, SettingsError
from payhook.queries import all_queries, parse_queries
from payhook.settings import Secret, Settings, parse_duration


def test_settings_defaults_and_overrides() -> None:
    s = Settings.from_env({"PAYHOOK_QUEUE": "q", "PAYHOOK_RECEIPT_RETENTION": "400d"})
    assert s.queue == "q" and s.redis_url.startswith("redis://")
    assert s.receipt_retention == 400 * 86400
    assert s.result_ttl == 600
    assert Settings.from_env({"PAYHOOK_RESULT_TTL": "2m"}).result_ttl == 120


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"DATABASE_URL": "mysql://x"}, "DATABASE_URL"),
        ({"REDIS_URL": "http://x"}, "REDIS_URL"),
        ({"PAYHOOK_MAX_BODY": "big"}, "PAYHOOK_MAX_BODY"),
        ({"PAYHOOK_JOB_TIMEOUT": "0"}, "PAYHOOK_JOB_TIMEOUT"),
        ({"PAYHOOK_OUTBOX_SLA": "soon"}, "PAYHOOK_OUTBOX_SLA"),
        ({"PAYHOOK_LOG_LEVEL": "LOUD"}, "PAYHOOK_LOG_LEVEL"),
        ({"PAYHOOK_RESULT_TTL": "500ms"}, "PAYHOOK_RESULT_TTL"),
    ],
)
def test_bad_setting_names_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(SettingsError, match=name):
        Settings.from_env(env)


def test_secrets_never_show_in_repr() -> None:
    s = Settings.from_env({"DATABASE_URL": "postgresql://u:hunter2@db/x"})
    assert "hunter2" not in repr(s) and isinstance(s.database_url, Secret)


def test_durations() -> None:
    assert parse_duration("X", "250ms") == 0.25
    assert parse_duration("X", "5m") == 300
    with pytest.raises(SettingsError):
        parse_duration("X", "-1s")


def test_query_loader_parses_headers_and_descriptions() -> None:
    queries = parse_queries("-- one --\n-- does one\nSELECT 1;\n\n-- two --\nSELECT 2\n")
    assert queries == {"one": "SELECT 1", "two": "SELECT 2"}


@pytest.mark.parametrize(
    "text", ["-- a --\nSELECT 1\n-- a --\nSELECT 2", "SELECT 1", "-- a --\n-- only words\n"]
)
def test_query_loader_rejects_malformed_files(text: str) -> None:
    with pytest.raises(QueryFileError):
        parse_queries(text)


def test_shipped_queries_load() -> None:
    assert {"apply_event", "replay_exception", "insert_anomaly"} <= set(all_queries())


def test_envelope_round_trip_keeps_exact_bytes() -> None:
    env = Envelope(
        "3f2c9e36-0d0e-4b7c-9d3e-8f1f1a1b2c3d",
        b"\xff\x00{}",
        {"Webhook-Id": "m"},
        datetime.now(UTC),
        "7d1d8a2e-5a43-4a53-8f43-0f5e2b1c9a10",
    )
    back = Envelope.from_json(env.to_json())
    assert back.body == b"\xff\x00{}" and back.headers == {"webhook-id": "m"}


ENDPOINT_ID = "3f2c9e36-0d0e-4b7c-9d3e-8f1f1a1b2c3d"
DELIVERY_ID = "7d1d8a2e-5a43-4a53-8f43-0f5e2b1c9a10"


def _envelope(body: bytes) -> Envelope:
    return Envelope(ENDPOINT_ID, body, {}, datetime.now(UTC), DELIVERY_ID)


@pytest.mark.parametrize(
    "body",
    [
        b'{"amount": 1500, "name": "Caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x92\xb3"}',
        b"\xef\xbb\xbf{}",  # a byte order mark
        b'{"a": "\\u00e9 \\" \\n"}\r\n\t\x00',
        b"",
    ],
)
def test_a_utf8_body_travels_as_text_through_json_and_comes_back_byte_for_byte(
    body: bytes,
) -> None:
    data = _envelope(body).to_json()
    assert data["v"] == 2 and "body_b64" not in data
    assert data["body"] == body.decode()
    # As RQ's JSON serializer writes it and a worker reads it.
    assert Envelope.from_json(json.loads(json.dumps(data))).body == body
    assert Envelope.from_json(orjson.loads(orjson.dumps(data))).body == body


def test_a_body_that_is_not_utf8_travels_as_base64() -> None:
    for body in (b"\xff{}", b"\xed\xa0\x80", b"\xc3"):  # invalid, a surrogate, cut short
        data = _envelope(body).to_json()
        assert "body" not in data
        assert Envelope.from_json(json.loads(json.dumps(data))).body == body


def test_a_version_1_envelope_queued_before_an_upgrade_is_still_read() -> None:
    data = {
        "v": 1,
        "endpoint_id": ENDPOINT_ID,
        "body_b64": base64.b64encode(b'{"id": 1}').decode(),
        "headers": {"Webhook-Id": "m"},
        "received_at": "2026-01-01T00:00:00+00:00",
        "delivery_id": DELIVERY_ID,
    }
    back = Envelope.from_json(data)
    assert back.body == b'{"id": 1}' and back.headers == {"webhook-id": "m"}
    # Version 1 had no text body.
    with pytest.raises(MalformedJob):
        Envelope.from_json({k: v for k, v in data.items() if k != "body_b64"} | {"body": "{}"})


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {"v": 0},
        {"v": "1"},
        {"v": True},
        {"v": 1, "endpoint_id": "x"},
        *(
            {
                "v": 2,
                "endpoint_id": ENDPOINT_ID,
                "headers": {},
                "received_at": "2026-01-01T00:00:00+00:00",
                "delivery_id": DELIVERY_ID,
            }
            | body
            for body in (
                {},  # no body at all
                {"body": "{}", "body_b64": "e30="},  # both
                {"body": 7},
                {"body": "\udc80"},  # a lone surrogate: no UTF-8 body gives one
                {"body_b64": "!!"},
            )
        ),
        {
            "v": 1,
            "endpoint_id": "3f2c9e36-0d0e-4b7c-9d3e-8f1f1a1b2c3d",
            "body_b64": "!!",
            "headers": {},
            "received_at": "2026-01-01T00:00:00+00:00",
            "delivery_id": "7d1d8a2e-5a43-4a53-8f43-0f5e2b1c9a10",
        },
    ],
)
def test_envelope_rejects_what_payhook_did_not_write(data: object) -> None:
    with pytest.raises(MalformedJob):
        Envelope.from_json(data)


def test_envelope_of_a_later_version_is_not_malformed_but_newer() -> None:
    with pytest.raises(NewerEnvelope) as raised:
        Envelope.from_json({"v": 4, "body": "{}"})
    assert raised.value.version == 4


def part_envelope(**part: object) -> dict[str, object]:
    proof = part_proof("s", ENDPOINT, REQUEST, 0, 2, b"{}")
    fields = {"request_id": REQUEST, "index": 0, "count": 2, "proof": proof} | part
    return {
        "v": 3,
        "endpoint_id": ENDPOINT,
        "headers": {},
        "body": "{}",
        "received_at": "2026-12-01T10:00:00+00:00",
        "delivery_id": "00000000-0000-4000-8000-000000000002",
        "part": fields,
    }


ENDPOINT = "00000000-0000-4000-8000-000000000001"
REQUEST = "00000000-0000-4000-8000-000000000003"


def test_a_part_round_trips_and_its_proof_holds_only_for_its_secret_and_place() -> None:
    envelope = Envelope.from_json(part_envelope())
    assert envelope.part is not None and envelope.to_json()["v"] == 3
    assert Envelope.from_json(envelope.to_json()) == envelope
    assert part_proven(envelope, ["other", "s"])
    assert not part_proven(envelope, ["other"])
    moved = Envelope.from_json(part_envelope(index=1))
    assert not part_proven(moved, ["s"])
    single = Envelope.from_json(part_envelope() | {"v": 2})
    assert single.part is None and not part_proven(single, ["s"])
    assert single.to_json()["v"] == 2


@pytest.mark.parametrize(
    "part",
    [
        {"index": 2},
        {"index": -1},
        {"count": 0},
        {"index": True},
        {"proof": 5},
        {"request_id": "not a uuid"},
    ],
)
def test_a_part_payhook_did_not_write_is_malformed(part: dict[str, object]) -> None:
    with pytest.raises(MalformedJob):
        Envelope.from_json(part_envelope(**part))
    with pytest.raises(MalformedJob):
        Envelope.from_json(part_envelope() | {"part": "a string"})
