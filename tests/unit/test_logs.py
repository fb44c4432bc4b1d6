"""Log lines: one JSON object per line, whatever the stream and the values."""

from __future__ import annotations

import asyncio
import io
import json
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import structlog

from payhook import logs
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


class CountingBytes(io.BytesIO):
    """A binary stream that counts its writes, as a raw file (PYTHONUNBUFFERED) would."""

    writes = 0
    #: The text stream over it, kept alive: collecting it would close this one.
    text: io.TextIOWrapper

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes += 1
        return super().write(data)


def _binary_logging() -> CountingBytes:
    raw = CountingBytes()
    raw.text = BinaryBacked(raw, encoding="utf-8")
    configure_logging("INFO", stream=raw.text)
    return raw


def test_outside_an_event_loop_each_line_is_written_at_once() -> None:
    raw = _binary_logging()
    log = structlog.get_logger("t")
    log.info("first")
    assert [line["event"] for line in _lines(raw.getvalue().decode())] == ["first"]
    log.info("second")
    assert [line["event"] for line in _lines(raw.getvalue().decode())] == ["first", "second"]
    assert raw.writes == 2


def test_inside_an_event_loop_a_turns_lines_are_written_together_at_the_next_turn() -> None:
    raw = _binary_logging()
    log = structlog.get_logger("t")
    seen_during_turn: list[bytes] = []

    async def requests() -> None:
        for number in range(5):
            log.info("webhook_received", number=number)
        seen_during_turn.append(raw.getvalue())
        await asyncio.sleep(0)  # the loop turns: the callback writes
        log.info("next_turn")
        await asyncio.sleep(0)

    asyncio.run(requests())
    assert seen_during_turn == [b""]
    lines = _lines(raw.getvalue().decode())
    assert [line.get("number") for line in lines] == [0, 1, 2, 3, 4, None]
    assert lines[-1]["event"] == "next_turn"
    assert raw.writes == 2


def test_lines_of_a_loop_closed_before_its_next_turn_are_written_at_exit() -> None:
    raw = _binary_logging()
    loop = asyncio.new_event_loop()

    async def request() -> None:
        structlog.get_logger("t").info("last_words")

    loop.run_until_complete(request())
    loop.close()
    logs._write_left_over()  # what atexit runs
    logs._write_left_over()
    assert [line["event"] for line in _lines(raw.getvalue().decode())] == ["last_words"]


def _standard_chain_line(method_name: str, event_dict: dict[str, object]) -> bytes:
    """The line structlog's own processors would write."""
    for processor in (
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(serializer=logs.dumps),
    ):
        event_dict = processor(None, method_name, event_dict)
    assert isinstance(event_dict, bytes)
    return event_dict


@pytest.mark.parametrize("method_name", ["info", "warn", "warning", "error", "exception"])
def test_the_fused_processor_writes_structlogs_own_line_key_for_key(method_name: str) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        exc_info = sys.exc_info()
    event = {
        "event": "webhook_received",
        "status": 202,
        "tenant": "café",
        "odd": object.__new__(object),
        "exc_info": exc_info if method_name == "exception" else None,
    }
    if event["exc_info"] is None:
        del event["exc_info"]
    ours = json.loads(logs.json_line(None, method_name, dict(event)))
    theirs = json.loads(_standard_chain_line(method_name, dict(event)))
    assert list(ours) == list(theirs)  # the same keys, in the same order
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z"
    assert re.fullmatch(stamp, ours.pop("timestamp"))
    assert re.fullmatch(stamp, theirs.pop("timestamp"))
    assert ours == theirs
    if method_name == "exception":
        assert "ValueError: boom" in ours["exception"]
