"""Log lines: one JSON object per line, whatever the stream and the values."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import structlog

from payhook.logs import configure_logging


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


class BinaryBacked(io.TextIOWrapper):
    def isatty(self) -> bool:
        return False


class TextOnly(io.StringIO):
    def isatty(self) -> bool:
        return False


def _lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def test_a_stream_with_a_buffer_gets_json_lines_written_as_bytes() -> None:
    raw = io.BytesIO()
    stream = BinaryBacked(raw, encoding="utf-8")
    configure_logging("INFO", stream=stream)
    log = structlog.get_logger("t")
    log.info("webhook_received", status=202, tenant="café", at=datetime(2026, 1, 2, tzinfo=UTC))
    log.debug("not_written")
    [line] = _lines(raw.getvalue().decode())
    assert line["event"] == "webhook_received"
    assert line["status"] == 202
    assert line["tenant"] == "café"
    assert line["level"] == "info"
    assert line["at"] == "2026-01-02T00:00:00+00:00"
    assert "timestamp" in line


def test_a_text_only_stream_gets_the_same_lines() -> None:
    stream = TextOnly()
    configure_logging("INFO", stream=stream)
    structlog.get_logger("t").info("outbox_done", counts={200: 3})
    [line] = _lines(stream.getvalue())
    assert line["event"] == "outbox_done"
    assert line["counts"] == {"200": 3}


def test_a_value_orjson_refuses_is_still_logged() -> None:
    stream = TextOnly()
    configure_logging("INFO", stream=stream)
    structlog.get_logger("t").info("big", value=2**70, other=object.__new__(object))
    [line] = _lines(stream.getvalue())
    assert line["value"] == 2**70
    assert str(line["other"]).startswith("<object object")
