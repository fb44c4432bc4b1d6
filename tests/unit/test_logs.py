"""Log lines: one JSON object per line, whatever the stream and the values."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

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


def _standard_chain_line(method_name: str, event_dict: Any) -> bytes:
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
        "huge": 2**70,  # beyond orjson: rendered by json instead
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


WRITER = """
import asyncio, sys
import structlog
from payhook.logs import configure_logging
configure_logging("INFO", json=True)
log = structlog.get_logger()
async def main():
    for turn in range(100):
        for i in range(50):  # 50 requests answered in one turn: some 15 KB
            log.info("webhook_received", worker=sys.argv[1], turn=turn, i=i, pad="x" * 200)
        await asyncio.sleep(0)
asyncio.run(main())
"""


def test_processes_sharing_a_pipe_never_split_each_others_lines() -> None:
    """`payhook ingress --workers N`: N processes, one stdout pipe, a slow reader."""
    read, write = os.pipe()
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, name], stdout=write, env=env)
        for name in "ABC"
    ]
    os.close(write)
    lines = []
    with os.fdopen(read, "rb") as pipe:
        for number, line in enumerate(pipe):
            lines.append(line)
            if number % 500 == 0:
                time.sleep(0.01)  # the pipe fills up meanwhile
    for writer in writers:
        assert writer.wait(timeout=60) == 0
    assert len(lines) == 3 * 100 * 50
    assert all(json.loads(line)["event"] == "webhook_received" for line in lines)


class Trickle(io.RawIOBase):
    """A raw file that takes at most 100 bytes per write, as a pipe may."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        taken = bytes(data[:100])
        self.data += taken
        return len(taken)


def test_a_write_the_stream_takes_in_part_is_finished() -> None:
    stream = Trickle()
    lines = [b'{"n": %d, "pad": "%s"}' % (n, b"x" * 300) for n in range(40)]
    logs._write_lines(stream, lines)  # type: ignore[arg-type]
    assert stream.data.split(b"\n")[:-1] == lines


def test_each_write_is_whole_lines_of_at_most_pipe_buf_bytes() -> None:
    raw = _binary_logging()
    chunks: list[bytes] = []
    write = raw.write

    def recording(data: bytes) -> int:
        chunks.append(bytes(data))
        return write(data)

    raw.write = recording  # type: ignore[method-assign]

    async def turn() -> None:
        for number in range(60):
            structlog.get_logger("t").info("webhook_received", number=number, pad="x" * 200)
        await asyncio.sleep(0)

    asyncio.run(turn())
    assert len(chunks) > 1
    for chunk in chunks:
        assert chunk.endswith(b"\n") and len(chunk) <= logs.PIPE_BUF
    assert [line["number"] for line in _lines(b"".join(chunks).decode())] == list(range(60))


def test_a_loop_stopped_before_its_turn_does_not_hold_a_later_loops_lines() -> None:
    raw = _binary_logging()
    first = asyncio.new_event_loop()
    first.call_soon(structlog.get_logger("t").info, "stranded")
    first.call_soon(first.stop)
    first.run_forever()  # stopped with the turn's write still scheduled

    async def later() -> None:
        for number in range(3):
            structlog.get_logger("t").info("later", n=number)
        await asyncio.sleep(0)

    asyncio.run(later())
    assert [line.get("n") for line in _lines(raw.getvalue().decode())] == [0, 1, 2]
    first.close()
    logs._write_left_over()
    assert _lines(raw.getvalue().decode())[-1]["event"] == "stranded"
