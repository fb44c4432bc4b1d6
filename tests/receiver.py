"""A fulfilment endpoint for tests: a real HTTP server process that records every request.

Run as `python -m tests.receiver --log requests.jsonl --ready port.txt`; it binds
127.0.0.1 (a free port unless `--port`), writes the port to the ready file and
appends one JSON line per request: arrival time, method, path, headers
(lower-cased), body, the status it answered and the client's port (one per
connection). The line is written when the
request arrives, before any delay, so a test can see a delivery in flight.

Behaviour (`--status`, `--delay`, `--retry-after`) can be changed while it runs
with `POST /_control` and a JSON object of the same names, plus `statuses`: a
list of statuses answered first, one per request, before `status` applies, and
`location`: a `Location` header sent with every answer (for redirects).

`Receiver` starts and drives such a process from a test or a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

#: Path of the control endpoint; its requests are not recorded.
CONTROL_PATH = "/_control"
#: Seconds a test waits for the process to bind its port.
START_TIMEOUT = 10.0
ROOT = Path(__file__).resolve().parent.parent


class Behaviour:
    """How the server answers; changed through the control endpoint."""

    def __init__(self, status: int, delay: float, retry_after: str | None) -> None:
        self.lock = threading.Lock()
        self.status = status
        self.delay = delay
        self.retry_after = retry_after
        self.statuses: list[int] = []
        self.location: str | None = None

    def update(self, changes: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            for name in ("status", "delay", "retry_after", "statuses", "location"):
                if name in changes:
                    setattr(self, name, changes[name])
            return self.snapshot()

    def next_answer(self) -> tuple[int, float, dict[str, str]]:
        """The status, the delay before answering and the extra headers."""
        with self.lock:
            status = self.statuses.pop(0) if self.statuses else self.status
            extra = {"retry-after": self.retry_after} if self.retry_after is not None else {}
            if self.location is not None:
                extra["location"] = self.location
            return status, self.delay, extra

    def snapshot(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "delay": self.delay,
            "retry_after": self.retry_after,
            "statuses": list(self.statuses),
            "location": self.location,
        }


class Recorder:
    def __init__(self, path: Path) -> None:
        self.lock = threading.Lock()
        self.file = path.open("a", encoding="utf-8")

    def write(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry) + "\n"
        with self.lock:
            self.file.write(line)
            self.file.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default of 5 resets bursts of new connections

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # a client hanging up is no error


def make_handler(behaviour: Behaviour, recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes; without TCP_NODELAY the second
        # waits for a delayed ACK (~40 ms) and the receiver looks slow.
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            arrived = time.time()
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            if self.path == CONTROL_PATH:
                self._answer(200, json.dumps(behaviour.update(json.loads(body))).encode())
                return
            status, delay, extra = behaviour.next_answer()
            recorder.write(
                {
                    "t": arrived,
                    "method": self.command,
                    "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": body.decode("utf-8", "replace"),
                    "status": status,
                    "client_port": self.client_address[1],
                }
            )
            if delay:
                time.sleep(delay)
            self._answer(status, b'{"ok":' + (b"true" if status < 300 else b"false") + b"}", extra)

        def _answer(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
            try:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                for name, value in (extra or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client went away while we waited

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the JSON lines are the record

    return Handler


def serve(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="record every request; answer as configured")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--ready", type=Path, required=True)
    parser.add_argument("--status", type=int, default=200)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--retry-after")
    args = parser.parse_args(argv)
    behaviour = Behaviour(args.status, args.delay, args.retry_after)
    server = Server(("127.0.0.1", args.port), make_handler(behaviour, Recorder(args.log)))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    tmp = args.ready.with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(args.ready)  # atomically: a reader never sees a partial port
    server.serve_forever(poll_interval=0.1)
    server.server_close()


class Receiver:
    """A receiver process: start it, point deliveries at `url`, read what it saw."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int = 0,
        status: int = 200,
        delay: float = 0.0,
        retry_after: str | None = None,
    ) -> None:
        self.directory = directory
        self.log = directory / "receiver.jsonl"
        self.port = port
        self.options = ["--status", str(status), "--delay", str(delay)]
        if retry_after is not None:
            self.options += ["--retry-after", retry_after]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/fulfil"

    def start(self) -> Receiver:
        """Start the process (on `port` if set, e.g. a restart) and wait until it listens."""
        self.directory.mkdir(parents=True, exist_ok=True)
        ready = self.directory / f"receiver-{time.monotonic_ns()}.port"
        command = [sys.executable, "-m", "tests.receiver", "--log", str(self.log)]
        command += ["--ready", str(ready), "--port", str(self.port), *self.options]
        self.process = subprocess.Popen(command, cwd=ROOT)
        deadline = time.monotonic() + START_TIMEOUT
        while not ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"the receiver exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("the receiver did not start")
            time.sleep(0.02)
        self.port = int(ready.read_text())
        return self

    def configure(self, **changes: Any) -> dict[str, Any]:
        """Change how it answers from now on (status, delay, retry_after, statuses, location)."""
        response = httpx.post(f"http://127.0.0.1:{self.port}{CONTROL_PATH}", json=changes)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def requests(self) -> list[dict[str, Any]]:
        """Every recorded request, in arrival order, across restarts."""
        if not self.log.exists():
            return []
        lines = self.log.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def keys(self) -> list[str]:
        """The `Idempotency-Key` of every recorded request."""
        return [r["headers"].get("idempotency-key", "") for r in self.requests()]

    def stop(self) -> None:
        """Stop it; connections are refused until it is started again."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    serve(sys.argv[1:])
