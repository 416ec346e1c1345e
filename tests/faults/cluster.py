"""Three nats-servers as one JetStream cluster on loopback, for the fault suite.

Each node is an :class:`~services.bus.EmbeddedNats` with a file store of its own
(``sync_interval: always``), a client port, a route port and a monitoring port, all free
loopback ports chosen once, so a node killed with SIGKILL starts again on the same store and
ports. :meth:`NatsCluster.start` returns once the nodes have elected a JetStream meta leader;
:meth:`NatsCluster.wait_ready` also provisions the streams, buckets and object store with
``replicas`` copies and waits until each has a leader and every replica is current.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from pathlib import Path

from nats.js import api

from services.bus import Bus, EmbeddedNats
from services.bus.provision import provision
from services.bus.server import NatsServerError, free_port

CLUSTER_NAME = "plexrl"
READY_S = 60.0


class NatsCluster:
    """``size`` nats-servers routed to one another; what :class:`~.harness.System` needs of
    its server (``url``, ``start``, ``stop``, ``kill``, ``proc``, ``port``), and each node."""

    def __init__(self, root: Path, size: int = 3) -> None:
        routes = [free_port() for _ in range(size)]
        self.nodes: list[EmbeddedNats] = []
        for i in range(size):
            others = ", ".join(
                f"nats-route://127.0.0.1:{p}" for j, p in enumerate(routes) if j != i
            )
            config = (
                f"server_name: n{i}\n"
                "cluster {\n"
                f"  name: {CLUSTER_NAME}\n"
                f"  listen: 127.0.0.1:{routes[i]}\n"
                f"  routes: [{others}]\n"
                "}\n"
            )
            self.nodes.append(
                EmbeddedNats(
                    store_dir=root / f"n{i}", monitor_port=free_port(), extra_config=config
                )
            )

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what ``--nats-url`` takes)."""
        return ",".join(n.url for n in self.nodes)

    @property
    def running(self) -> list[EmbeddedNats]:
        return [n for n in self.nodes if n.proc is not None]

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The first running node's process (None when every node is down)."""
        up = self.running
        return up[0].proc if up else None

    @property
    def port(self) -> int:
        """The client port of the first running node (of the first node when all are down)."""
        return (self.running or self.nodes)[0].port

    def pids(self) -> list[int]:
        return [n.proc.pid for n in self.nodes if n.proc is not None]

    def start(self) -> str:
        for node in self.nodes:
            node.start()
        self.wait_meta_leader()
        return self.url

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def jsz(self, node: EmbeddedNats) -> dict:
        url = f"http://127.0.0.1:{node.monitor_port}/jsz"
        with urllib.request.urlopen(url, timeout=2.0) as answer:
            return dict(json.load(answer))

    def clients(self, node: EmbeddedNats) -> list[str]:
        """The names of the clients connected to ``node`` (``plexrl-<service>``)."""
        url = f"http://127.0.0.1:{node.monitor_port}/connz?limit=1024"
        with urllib.request.urlopen(url, timeout=2.0) as answer:
            return [c.get("name", "") for c in json.load(answer).get("connections") or []]

    def meta_leader(self) -> str:
        """The meta leader every running node agrees on, or "" (none yet, or no quorum)."""
        leaders = set()
        for node in self.running:
            try:
                leaders.add((self.jsz(node).get("meta_cluster") or {}).get("leader") or "")
            except OSError:
                return ""
        return leaders.pop() if len(leaders) == 1 else ""

    def wait_meta_leader(self, timeout: float = READY_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.meta_leader()
            if leader:
                return leader
            time.sleep(0.1)
        raise NatsServerError(f"no JetStream meta leader within {timeout:.0f}s")

    async def wait_ready(self, replicas: int, timeout: float = READY_S) -> None:
        """Provision everything with ``replicas`` copies (as the services will), then wait until
        every stream (buckets and object stores are streams too) has a leader and current
        replicas."""
        bus = await Bus.connect(self.url, "faults-cluster", provision_streams=False, wait=timeout)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    await provision(bus.js, replicas=replicas)
                    break
                except Exception:  # JetStream not yet available on the node we asked
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            while True:
                waiting = [
                    info.config.name
                    for info in await bus.js.streams_info()
                    if not _settled(info, replicas)
                ]
                if not waiting:
                    return
                if time.monotonic() > deadline:
                    raise NatsServerError(f"streams without a leader or replicas: {waiting}")
                await asyncio.sleep(0.1)
        finally:
            await bus.close()


def _settled(info: api.StreamInfo, replicas: int) -> bool:
    cluster = info.cluster
    if cluster is None or not cluster.leader or (info.config.num_replicas or 1) != replicas:
        return False
    peers = cluster.replicas or []
    return len(peers) == replicas - 1 and all(p.current and not p.offline for p in peers)
