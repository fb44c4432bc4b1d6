"""Redis with Sentinel on this machine, for failover scenarios: one master,
two replicas and three Sentinels (Debian's `redis-server` and
`redis-sentinel`), each on a private port, in a folder of the test's own.
Two replicas: once one is promoted, the other follows it as part of the
failover, so a master with a replica is back within seconds.

The master and the replica persist as compose runs Redis (AOF, `appendfsync
always`); the Sentinels agree that a master is down after `DOWN_AFTER_MS`
with a quorum of 2, and promote the replica.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

from redis import Redis
from redis.sentinel import Sentinel

from tests.e2e.stack import RedisServer, free_port
from tests.processes import wait_until

MASTER_NAME = "payhook"
#: Milliseconds without an answer before a Sentinel thinks the master down.
DOWN_AFTER_MS = 1000


class SentinelGroup:
    """A master, its two replicas and three Sentinels watching them."""

    def __init__(self, root: Path) -> None:
        self.root = root / "sentinels"
        self.nodes = [RedisServer(self.root, name) for name in ("a", "b", "c")]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    def env(self) -> dict[str, str]:
        """A process's settings to reach the master through the Sentinels."""
        return {
            # Only the database counts: the Sentinels say where the master is.
            "REDIS_URL": "redis://sentinel-managed/0",
            "PAYHOOK_REDIS_SENTINELS": self.addresses,
            "PAYHOOK_REDIS_MASTER": MASTER_NAME,
        }

    def start(self) -> None:
        master, *replicas = self.nodes
        master.start()
        for replica in replicas:
            replica.start(replica_of=master.port)
        for port in self.sentinel_ports:
            config = self.root / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
                f"logfile {self.root}/sentinel-{port}.log\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} 5000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self.sentinels.append(
                subprocess.Popen(["redis-sentinel", str(config)], stdout=subprocess.DEVNULL)
            )
        wait_until(lambda: self.master_port() == master.port, 10, "the Sentinels")
        wait_until(lambda: self.replicas_of(master) == 2, 20, "the replicas to sync")

    def master_port(self) -> int | None:
        """The master's port as the Sentinels name it now."""
        manager = Sentinel(
            [("127.0.0.1", port) for port in self.sentinel_ports], socket_timeout=0.5
        )
        try:
            return int(manager.discover_master(MASTER_NAME)[1])
        except Exception:
            return None

    def master(self) -> RedisServer:
        port = self.master_port()
        (node,) = [n for n in self.nodes if n.port == port]
        return node

    def replicas_of(self, node: RedisServer) -> int:
        return online_replicas(node.port)

    def stop(self) -> None:
        for process in self.sentinels:
            process.terminate()
            process.wait(timeout=10)
        for node in self.nodes:
            node.kill(signal.SIGTERM)
        shutil.rmtree(self.root, ignore_errors=True)


def online_replicas(port: int) -> int:
    """Replicas of the Redis on `port` that are synced and streaming its writes."""
    client = Redis(port=port, socket_timeout=1)
    try:
        info = client.info("replication")
    except Exception:
        return 0
    finally:
        client.close()
    return sum(
        1
        for key, value in info.items()
        if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
    )
