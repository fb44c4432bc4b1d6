"""A local fake of a gateway's REST API, for the resources events link to.

`FakeApi` serves `GET [/prefix]/{collection}/{id}` from dictionaries, wrapped
as the GoCardless API does (`{"payments": {...}}`) or bare as Mollie's
(`wrap=False`, `prefix="/v2"`), in a thread of the test process on
127.0.0.1; consumers in other processes reach it over HTTP. It checks the
bearer token, records every request, and can be told to fail: `fail_next`
statuses are answered first, one per request, and `delay` holds each answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class FakeApi:
    def __init__(self, token: str, *, wrap: bool = True, prefix: str = "") -> None:
        self.token = token
        self.wrap = wrap
        self.prefix = prefix
        #: Resources by collection and id.
        self.resources: dict[str, dict[str, dict[str, Any]]] = {}
        #: Statuses answered before any resource, one per request.
        self.fail_next: list[int] = []
        #: Seconds each answer waits.
        self.delay = 0.0
        #: (method, path, headers) of every request.
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, collection: str, resource: dict[str, Any]) -> None:
        with self._lock:
            self.resources.setdefault(collection, {})[resource["id"]] = resource

    def answer(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        with self._lock:
            self.requests.append((method, path, headers))
            if self.fail_next:
                status = self.fail_next.pop(0)
                return status, json.dumps({"error": {"code": status}}).encode()
            if headers.get("authorization") != f"Bearer {self.token}":
                return 401, b'{"error": {"code": 401, "message": "Invalid token"}}'
            parts = path.removeprefix(self.prefix).strip("/").split("/")
            found = None
            if method == "GET" and len(parts) == 2 and path.startswith(self.prefix):
                found = self.resources.get(parts[0], {}).get(parts[1])
            if found is None:
                return 404, b'{"error": {"code": 404}}'
            return 200, json.dumps({parts[0]: found} if self.wrap else found).encode()

    @contextmanager
    def running(self) -> Iterator[FakeApi]:
        def answer(path: str, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
            status, body = self.answer("GET", path, headers)
            if self.delay:
                time.sleep(self.delay)
            return status, body, {}

        with serving(answer) as server:
            self._server = server
            yield self


class FakeStripeEvents:
    """Stripe's `GET /v1/events`, as its API pages them: newest first,
    `created[gte]`, `limit` and `starting_after`, `has_more`. `fail_next`
    holds (status, retry-after) answers given first, one per request."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.events: list[dict[str, Any]] = []
        self.fail_next: list[tuple[int, str | None]] = []
        #: The query of every request, parsed.
        self.queries: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def answer(self, path: str, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        parts = urlsplit(path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        with self._lock:
            self.queries.append(query)
            if self.fail_next:
                status, retry_after = self.fail_next.pop(0)
                extra = {"retry-after": retry_after} if retry_after else {}
                error = {"error": {"type": "api_error", "message": f"fake {status}"}}
                return status, json.dumps(error).encode(), extra
            if headers.get("authorization") != f"Bearer {self.key}" or parts.path != "/v1/events":
                return 401, b'{"error": {"type": "invalid_request_error"}}', {}
            since = int(query.get("created[gte]", "0"))
            newest = sorted(self.events, key=lambda e: (e["created"], e["id"]), reverse=True)
            listed = [e for e in newest if e["created"] >= since]
            after = query.get("starting_after")
            if after is not None:
                ids = [e["id"] for e in listed]
                listed = listed[ids.index(after) + 1 :] if after in ids else []
            limit = int(query.get("limit", "10"))
            page = {
                "object": "list",
                "url": "/v1/events",
                "data": listed[:limit],
                "has_more": len(listed) > limit,
            }
            return 200, json.dumps(page).encode(), {}

    @contextmanager
    def running(self) -> Iterator[FakeStripeEvents]:
        # Looked up per request: a test may replace `answer` while it runs.
        with serving(lambda path, headers: self.answer(path, headers)) as server:
            self._server = server
            yield self


Answer = Callable[[str, dict[str, str]], tuple[int, bytes, dict[str, str]]]


@contextmanager
def serving(answer: Answer) -> Iterator[ThreadingHTTPServer]:
    """An HTTP server on 127.0.0.1 (a free port) in a thread, answering every
    GET with `answer(path, headers)`: status, JSON body, extra headers."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, body, extra = answer(self.path, headers)
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            for name, value in extra.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
