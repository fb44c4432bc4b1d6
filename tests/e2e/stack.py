"""A whole payhook stack of real processes, for end-to-end scenarios.

`Stack` starts its own PostgreSQL (initdb into a temporary folder, own port)
and Redis (own port, AOF with `appendfsync always`), so scenarios can stop,
kill and restart them; then 2 ingress instances, 3 consumers, 1 outbox worker
and a fulfilment receiver that records every request. Every process can be
killed and restarted; `settle` waits until the queue and the outbox are empty.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from redis import Redis
from rq.registry import FailedJobRegistry, ScheduledJobRegistry, StartedJobRegistry

from control import admin
from payhook.db import Row, connect
from payhook.gateways.base import NO_CONFIG, Config
from payhook.queue import events_queue, redis_connection
from payhook.sealing import Keyring
from payhook.settings import Settings
from tests.factories import LOCAL_RECEIVER_SETTINGS, LOCAL_RECEIVERS, TEST_SECRETS_KEY, Shop
from tests.processes import start, stop, wait_until
from tests.receiver import Receiver

#: Settings that make recovery quick enough for tests.
FAST = {
    "PAYHOOK_JOB_TIMEOUT": "5",
    "PAYHOOK_JOB_GRACE": "2",
    "PAYHOOK_MAINTENANCE_INTERVAL": "1",
    "PAYHOOK_JOB_RETRY_INTERVALS": "0,1,1,2,2,3,3,5,5,5,5,5,5",
    "PAYHOOK_ENDPOINT_REFRESH": "0.5s",
    "PAYHOOK_OUTBOX_LEASE": "4s",
    "PAYHOOK_OUTBOX_TIMEOUT": "1s",
    "PAYHOOK_OUTBOX_BACKOFF": "0.2s",
    "PAYHOOK_OUTBOX_BACKOFF_MAX": "1s",
    "PAYHOOK_OUTBOX_POLL": "0.5s",
    "PAYHOOK_LOG_LEVEL": "INFO",
} | LOCAL_RECEIVER_SETTINGS


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_postgres(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


class PostgresServer:
    """A PostgreSQL cluster of the test's own."""

    def __init__(self, root: Path) -> None:
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        if not versions:
            raise RuntimeError("PostgreSQL binaries not found under /usr/lib/postgresql")
        self.bin = versions[-1]
        self.data = root / "pg"
        self.port = free_port()

    def url(self, database: str = "payhook") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def init(self) -> None:
        self.data.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.data, "postgres")
        self._run(
            [
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
            ]
        )

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c max_connections=200"
        )
        self._run(
            [
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.data / "server.log"),
                "-o",
                options,
                "-w",
                "start",
            ]
        )

    def stop(self, mode: str = "fast") -> None:
        """`fast` shuts down cleanly; `immediate` is a crash (recovery on next start)."""
        self._run(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"], check=False
        )

    def _run(self, command: list[str], check: bool = True) -> None:
        subprocess.run(
            _as_postgres(command),
            check=check,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=60,
        )


class RedisServer:
    """A Redis of the test's own, with the AOF as compose runs it; a replica
    of another with `replica_of`."""

    def __init__(self, root: Path, name: str = "redis") -> None:
        self.dir = root / name
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, replica_of: int | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        command = [
            "redis-server",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        if replica_of is not None:
            command += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        client = Redis.from_url(self.url, socket_timeout=1)
        wait_until(lambda: _pings(client), 10, f"redis-server on {self.port} to answer")
        client.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)
            self.process = None


class PgBouncer:
    """Debian's PgBouncer in transaction mode in front of a PostgreSQL on
    127.0.0.1 (a `PostgresServer`, or the suite's server).

    Clients log in as `USER`, a member of payhook_app made by `create_user`
    (trust, as the test clusters); the pooler's server sessions log in the same.
    """

    BINARY = Path("/usr/sbin/pgbouncer")
    USER = "payhook_pooled"

    def __init__(self, root: Path, upstream_port: int) -> None:
        self.dir = root / "pgbouncer"
        self.upstream_port = upstream_port
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "payhook") -> str:
        return f"postgresql://{self.USER}@127.0.0.1:{self.port}/{database}"

    def create_user(self, admin_url: str) -> None:
        """The pooled login role, once per PostgreSQL server (roles are the cluster's)."""
        with psycopg.connect(admin_url, autocommit=True) as conn:
            try:
                conn.execute(f"CREATE ROLE {self.USER} LOGIN IN ROLE payhook_app")
            except (psycopg.errors.DuplicateObject, psycopg.errors.UniqueViolation):
                pass  # made by an earlier run, or by another worker just now

    def start(self) -> None:
        assert self.BINARY.exists(), "pgbouncer is missing: run scripts/services.sh"
        self.dir.mkdir(exist_ok=True)
        (self.dir / "userlist.txt").write_text(f'"{self.USER}" ""\n"postgres" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={self.upstream_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir}/userlist.txt\n"
            "pool_mode = transaction\nmax_client_conn = 1000\ndefault_pool_size = 40\n"
            f"logfile = {self.dir}/pgbouncer.log\n"
        )
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            for path in (self.dir, *self.dir.iterdir()):
                shutil.chown(path, "postgres")
        # A session of its own: stopping it signals runuser and PgBouncer alike.
        self.process = subprocess.Popen(
            _as_postgres([str(self.BINARY), str(self.dir / "pgbouncer.ini")]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_until(self._answers, 10, "pgbouncer to answer")

    def _answers(self) -> bool:
        try:
            psycopg.connect(self.url("postgres"), connect_timeout=1).close()
        except psycopg.OperationalError:
            return False
        return True

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=10)
            self.process = None


def _pings(client: Redis) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


@dataclass
class Stack:
    root: Path
    pg: PostgresServer = field(init=False)
    redis: RedisServer = field(init=False)
    receiver: Receiver = field(init=False)
    ingress: list[tuple[subprocess.Popen[bytes], int]] = field(default_factory=list)
    consumers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    outbox: list[subprocess.Popen[bytes]] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Every process's DATABASE_URL goes through PgBouncer in transaction
    #: mode; migrations and LISTEN take the direct URL.
    pooled: bool = False
    #: Start the stack's own Redis; False when `extra_env` names another
    #: (Sentinels, `tests.e2e.sentinels`).
    own_redis: bool = True

    def __post_init__(self) -> None:
        self.pg = PostgresServer(self.root)
        self.pgbouncer = PgBouncer(self.root, self.pg.port)
        self.redis = RedisServer(self.root)
        self.receiver = Receiver(self.root / "receiver")
        self.logs = self.root / "logs"
        self.logs.mkdir()

    @property
    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("PAYHOOK_")}
        return (
            base
            | {
                "DATABASE_URL": self.pg.url(),
                "REDIS_URL": self.redis.url,
                "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
            }
            | (self.pooled_env if self.pooled else {})
            | FAST
            | self.extra_env
        )

    @property
    def pooled_env(self) -> dict[str, str]:
        return {
            "DATABASE_URL": self.pgbouncer.url(),
            "PAYHOOK_DATABASE_POOLER": "transaction",
            "PAYHOOK_DATABASE_ROLE": "",
            "PAYHOOK_DATABASE_DIRECT_URL": self.pg.url(),
        }

    @property
    def settings(self) -> Settings:
        return Settings.from_env(self.env)

    # -- lifecycle ---------------------------------------------------------

    def start(self, ingresses: int = 2, consumers: int = 3, outbox_workers: int = 1) -> Stack:
        self.pg.init()
        self.pg.start()
        if self.own_redis:
            self.redis.start()
        self.receiver.start()
        migrate = subprocess.run(
            [*_payhook(), "migrate"], env=self.env, capture_output=True, text=True, timeout=60
        )
        assert migrate.returncode == 0, migrate.stderr
        if self.pooled:
            self.pgbouncer.create_user(self.pg.url())
            self.pgbouncer.start()
        for _ in range(ingresses):
            self.start_ingress()
        for _ in range(consumers):
            self.start_consumer()
        for _ in range(outbox_workers):
            self.start_outbox_worker()
        return self

    def start_ingress(self, **env: str) -> int:
        port = free_port()
        proc = start(
            ["ingress", "--port", str(port)], self.env | env, self.logs / f"ingress-{port}.log"
        )
        wait_until(lambda: _ready(port), 20, f"ingress on {port} to be ready")
        self.ingress.append((proc, port))
        return port

    def start_consumer(self, **env: str) -> subprocess.Popen[bytes]:
        proc = start(["consumer"], self.env | env, self.logs / f"consumer-{time.time_ns()}.log")
        self.consumers.append(proc)
        return proc

    def start_outbox_worker(self, **env: str) -> subprocess.Popen[bytes]:
        proc = start(["outbox-worker"], self.env | env, self.logs / f"outbox-{time.time_ns()}.log")
        self.outbox.append(proc)
        return proc

    @contextmanager
    def supervised(self) -> Iterator[None]:
        """Restart consumers and outbox workers that exit, as compose's restart policy does."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.5):
                for group, starter in (
                    (self.consumers, self.start_consumer),
                    (self.outbox, self.start_outbox_worker),
                ):
                    for proc in list(group):
                        if proc.poll() is not None:
                            group.remove(proc)
                            stop(proc)  # and its orphaned children
                            starter()

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def stop(self) -> None:
        for proc, _ in self.ingress:
            stop(proc)
        for proc in [*self.consumers, *self.outbox]:
            stop(proc)
        self.receiver.stop()
        self.redis.kill(signal.SIGTERM)
        self.pgbouncer.stop()
        self.pg.stop()

    def alive(self, procs: list[subprocess.Popen[bytes]]) -> list[subprocess.Popen[bytes]]:
        return [p for p in procs if p.poll() is None]

    # -- data --------------------------------------------------------------

    @contextmanager
    def db(self) -> Iterator[psycopg.Connection[Row]]:
        with connect(self.settings, "test", owner=True) as conn:
            yield conn

    def shop(self, gateway: str = "standard", config: Config = NO_CONFIG) -> Shop:
        with self.db() as conn:
            keyring = Keyring.from_settings(self.settings)
            tenant_id = admin.add_tenant(
                conn,
                "e2e",
                fulfilment_url=self.receiver.url,
                keyring=keyring,
                destinations=LOCAL_RECEIVERS,
            )
            endpoint = admin.add_endpoint(conn, tenant_id, gateway, keyring=keyring, config=config)
        shop = Shop(tenant_id, endpoint.endpoint_id, endpoint.secret, gateway)
        # The ingress learns new endpoints within PAYHOOK_ENDPOINT_REFRESH.
        time.sleep(1.0)
        return shop

    def order(
        self,
        shop: Shop,
        ref: str,
        gateway_order_id: str,
        amount: int = 1999,
        currency: str = "EUR",
    ) -> str:
        with self.db() as conn:
            return admin.add_order(conn, shop.tenant_id, ref, gateway_order_id, amount, currency)

    def count(self, sql: str, params: dict[str, Any] | None = None) -> int:
        with self.db() as conn:
            row = conn.execute(sql, params or {}).fetchone()
            assert row is not None
            return int(next(iter(row.values())))

    def url(self, shop: Shop, instance: int = 0) -> str:
        return f"http://127.0.0.1:{self.ingress[instance][1]}/webhooks/{shop.endpoint_id}"

    # -- waiting -----------------------------------------------------------

    def redis_client(self) -> Redis:
        """A client of the stack's Redis, wherever the settings say it is now."""
        return redis_connection(self.settings, timeout=5)

    def failed_jobs(self) -> int:
        client = self.redis_client()
        try:
            return FailedJobRegistry(queue=events_queue(client, self.settings)).count
        finally:
            client.close()

    def backlog(self) -> dict[str, int]:
        """What is left to do: jobs queued, popped, running or scheduled; outbox rows pending.

        A job a worker had just popped when it or Redis died waits in RQ's
        intermediate list until a maintenance pass (after a minute) sends it
        back through the retry path.
        """
        client = self.redis_client()
        try:
            queue = events_queue(client, self.settings)
            left = {
                "queued": queue.count,
                "intermediate": client.llen(queue.intermediate_queue.key),
                "started": StartedJobRegistry(queue=queue).count,
                "scheduled": ScheduledJobRegistry(queue=queue).count,
            }
        finally:
            client.close()
        left["outbox_pending"] = self.count(
            "SELECT count(*) AS n FROM payhook.payment_outbox WHERE state = 'pending'"
        )
        return left

    def settle(self, timeout: float) -> float:
        """Wait until every queued job ran and every outbox row was delivered; seconds taken."""
        started = time.monotonic()
        try:
            wait_until(lambda: not any(self.backlog().values()), timeout, "the stack to settle")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; still to do: {self.backlog()}") from None
        return time.monotonic() - started


def _payhook() -> list[str]:
    import sys

    return [sys.executable, "-m", "control.cli"]


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def running_stack(*, pooled: bool = False, **start_args: int) -> Iterator[Stack]:
    root = Path(tempfile.mkdtemp(prefix="payhook-e2e-", dir="/tmp"))
    root.chmod(0o755)
    stack = Stack(root, pooled=pooled)
    try:
        yield stack.start(**start_args)
    finally:
        stack.stop()
        shutil.rmtree(root, ignore_errors=True)
