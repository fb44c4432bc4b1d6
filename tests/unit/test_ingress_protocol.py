"""The read deadline of ingress.protocol, on uvicorn's protocol with a stand-in transport.

The first test is the contract: each part of uvicorn the protocol relies on.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from ingress.body import READ_DEADLINE
from ingress.protocol import MAX_HEAD, ReadDeadlineProtocol, http_protocol

#: Seconds each request gets here: long beside the pauses a loaded machine gives
#: a process, so that the "not yet" checks made at half of it hold.
TIMEOUT = 0.3
REQUEST = b"POST /webhooks/e HTTP/1.1\r\nhost: ingress\r\ncontent-length: 4\r\n\r\n"


class Transport(asyncio.Transport):
    """What the protocol writes, and whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5000)}.get(name)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class App:
    """An ASGI app that reads the body and answers 202, noting each scope."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def connect(
    loop: asyncio.AbstractEventLoop, app: App | None = None
) -> tuple[ReadDeadlineProtocol, Transport]:
    config = Config(app=app or App(), log_config=None, ws="none")
    protocol = ReadDeadlineProtocol(config, ServerState(), {}, loop, read_timeout=TIMEOUT)
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


def wait(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    loop.run_until_complete(asyncio.sleep(seconds))


def test_the_parts_of_uvicorn_the_protocol_relies_on(loop: asyncio.AbstractEventLoop) -> None:
    for name in (
        "connection_made",
        "connection_lost",
        "data_received",
        "on_message_begin",
        "on_headers_complete",
        "on_message_complete",
        "shutdown",
    ):
        assert callable(getattr(HttpToolsProtocol, name)), name
    params = list(inspect.signature(HttpToolsProtocol.__init__).parameters)
    assert params == ["self", "config", "server_state", "app_state", "_loop"]
    assert isinstance(ServerState().default_headers, list)
    assert "response_complete" in inspect.getsource(RequestResponseCycle.__init__)
    protocol, transport = connect(loop)
    assert protocol.loop is loop and protocol.transport is transport
    protocol.data_received(REQUEST)
    assert protocol.scope["method"] == "POST"
    assert protocol.cycle is not None and protocol.cycle.response_complete is False
    protocol.data_received(b"body")
    wait(loop, 0)
    assert protocol.cycle.response_complete is True


def test_the_option_uvicorn_is_given_builds_the_protocol_and_pickles_for_workers(
    loop: asyncio.AbstractEventLoop,
) -> None:
    option = pickle.loads(pickle.dumps(http_protocol(7.5)))
    config = Config(app=App(), log_config=None, http=option)
    config.load()
    protocol = config.http_protocol_class(  # type: ignore[call-arg]
        config=config, server_state=ServerState(), app_state={}, _loop=loop
    )
    assert isinstance(protocol, ReadDeadlineProtocol) and protocol.read_timeout == 7.5


def test_a_request_in_one_piece_arms_no_timer_and_tells_the_app_it_is_whole(
    loop: asyncio.AbstractEventLoop,
) -> None:
    app = App()
    protocol, transport = connect(loop, app)
    protocol.data_received(REQUEST + b"body")
    wait(loop, 0)
    assert protocol._timer is None  # the connection's timer stopped with the request
    assert transport.written.startswith(b"HTTP/1.1 202 ")
    [scope] = app.scopes
    deadline = scope["extensions"][READ_DEADLINE]
    assert deadline["complete"] is True
    assert deadline["at"] <= loop.time() + TIMEOUT
    wait(loop, 2 * TIMEOUT)
    assert not transport.closed  # kept alive


def test_a_head_not_in_by_the_deadline_is_408_and_closed(
    loop: asyncio.AbstractEventLoop,
) -> None:
    protocol, transport = connect(loop)
    protocol.data_received(REQUEST[:20])
    wait(loop, 2 * TIMEOUT)
    assert transport.written.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert transport.written.endswith(b'connection: close\r\n\r\n{"error": "request_timeout"}')
    assert transport.closed


def test_a_silent_connection_is_closed_without_a_word(loop: asyncio.AbstractEventLoop) -> None:
    _, transport = connect(loop)
    wait(loop, 2 * TIMEOUT)
    assert transport.closed and transport.written == b""


def test_the_next_request_on_a_kept_alive_connection_gets_its_own_deadline(
    loop: asyncio.AbstractEventLoop,
) -> None:
    protocol, transport = connect(loop)
    protocol.data_received(REQUEST + b"body")
    wait(loop, 2 * TIMEOUT)  # idle between requests: not the read deadline's business
    assert not transport.closed
    transport.written = b""
    protocol.data_received(REQUEST[:20])
    wait(loop, TIMEOUT / 2)
    assert not transport.closed
    wait(loop, TIMEOUT * 2)
    assert transport.written.startswith(b"HTTP/1.1 408 ") and transport.closed


def test_a_late_body_is_left_to_the_app_and_the_connection_closed_after_its_answer(
    loop: asyncio.AbstractEventLoop,
) -> None:
    app = App()
    protocol, transport = connect(loop, app)
    protocol.data_received(REQUEST + b"bo")
    wait(loop, 2 * TIMEOUT)
    assert transport.written == b"" and not transport.closed  # the app's to answer
    [scope] = app.scopes
    assert scope["extensions"][READ_DEADLINE]["complete"] is False
    protocol.data_received(b"dy")  # this app answers once the body is in
    wait(loop, 0)
    assert transport.written.startswith(b"HTTP/1.1 202 ")
    assert b"connection: close" in transport.written and transport.closed


def test_a_head_over_the_limit_is_431_and_closed(loop: asyncio.AbstractEventLoop) -> None:
    protocol, transport = connect(loop)
    protocol.data_received(b"POST /webhooks/e HTTP/1.1\r\nx-padding: ")
    protocol.data_received(b"p" * MAX_HEAD)
    assert transport.written.startswith(b"HTTP/1.1 431 ")
    assert transport.closed


def test_a_large_body_behind_a_small_head_is_not_a_large_head(
    loop: asyncio.AbstractEventLoop,
) -> None:
    protocol, transport = connect(loop)
    length = 2 * MAX_HEAD
    head = b"POST /webhooks/e HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % length
    protocol.data_received(head + b"x" * MAX_HEAD)
    protocol.data_received(b"x" * MAX_HEAD)
    wait(loop, 0)
    assert transport.written.startswith(b"HTTP/1.1 202 ")
