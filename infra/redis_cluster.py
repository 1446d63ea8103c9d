"""A real Redis Cluster on loopback: masters and replicas, redis-servers started and stopped by pid.

Used by the cluster tests and bench/cluster.py. Every node is an infra.redis_server.RedisServer
in the configuration spend-ceiling ships (AOF, noeviction) plus cluster mode, in a temp dir of
its own; `redis-cli --cluster create` assigns the slots and pairs each master with its replicas.
A master can be killed by pid to force a failover, and brought back to rejoin as a replica.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import redis
from redis.crc import key_slot

from infra.processes import free_port
from infra.redis_server import RedisServer

# Redis' default is 15 s. Two seconds let a test watch a whole failover (detection, election,
# promotion) in a few seconds, while a node starved of CPU for a second on a busy 2-core machine
# is still not failed by mistake in the middle of another test.
CLUSTER_NODE_TIMEOUT_MS = 2_000
# `redis-cli --cluster create` waits for the nodes to meet; a few seconds on a loaded 2-core box.
CREATE_TIMEOUT_S = 30.0
# Gossip converges in a few node timeouts, a failover in fewer; beyond this it is stuck.
SETTLE_TIMEOUT_S = 30.0
# One CLUSTER INFO / CLUSTER NODES / INFO to a loopback node; a node that takes longer is down.
NODE_QUERY_TIMEOUT_S = 1.0
POLL_INTERVAL_S = 0.05
SLOTS_COUNT = 16_384


def redis_cli_binary() -> str:
    found = shutil.which("redis-cli")
    if found is None:
        raise RuntimeError("redis-cli is not installed; it comes with redis-server (apt-get)")
    return found


def distinct_free_ports(count: int) -> list[int]:
    """Ports free now and distinct from each other (the kernel may hand out one port twice)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@dataclass(frozen=True)
class NodeView:
    """One node as some live node's CLUSTER NODES reports it."""

    port: int
    node_id: str
    master: bool
    failed: bool
    master_id: str
    slots: frozenset[int]


@dataclass
class LocalCluster:
    """A Redis Cluster of `masters_count` masters, each with `replicas_per_master` replicas."""

    masters_count: int = 3
    replicas_per_master: int = 1
    node_timeout_ms: int = CLUSTER_NODE_TIMEOUT_MS
    nodes: list[RedisServer] = field(default_factory=list, init=False)
    _stack: contextlib.ExitStack = field(
        default_factory=contextlib.ExitStack, init=False, repr=False
    )

    # -- life cycle ----------------------------------------------------------------------

    def start(self) -> LocalCluster:
        count = self.masters_count * (1 + self.replicas_per_master)
        ports = distinct_free_ports(2 * count)
        # The bus port is chosen too: the default, port + 10000, may be taken or past 65535.
        self.nodes = [
            RedisServer(
                port=port,
                durable=True,
                extra_args=(
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(bus_port),
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    # A master waits this long for more replicas before a full sync by default
                    # (5 s); each master here has one replica, so there is nothing to wait for.
                    "--repl-diskless-sync-delay", "0",
                ),
            )
            for port, bus_port in zip(ports[:count], ports[count:], strict=True)
        ]
        try:
            for node in self.nodes:
                # The stack stops each node by pid and deletes its directory, in reverse order.
                self._stack.enter_context(node)
            created = subprocess.run(
                [
                    redis_cli_binary(), "--cluster", "create",
                    *(f"127.0.0.1:{node.port}" for node in self.nodes),
                    "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=CREATE_TIMEOUT_S,
            )
            if created.returncode != 0:
                raise RuntimeError(
                    f"redis-cli --cluster create exited with {created.returncode}: "
                    f"{created.stdout[-2_000:]}{created.stderr[-2_000:]}"
                )
            self.wait_settled()
            self._wait_replicas_attached()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_replicas_attached(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Until every master that owns slots has its replicas: `--cluster create` assigns them
        after the slots, and a cluster can be settled (every slot owned, state ok) before they
        follow their masters. A failover test needs them there from the start."""
        deadline = time.monotonic() + timeout_s
        while True:
            short = [m.port for m in self.masters()
                     if len(self.replicas_of(m)) < self.replicas_per_master]
            if not short:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"masters {short} have no replica after {timeout_s} s")
            time.sleep(POLL_INTERVAL_S)

    def stop(self) -> None:
        self._stack.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- who holds what --------------------------------------------------------------------

    def live(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.process is not None]

    @property
    def url(self) -> str:
        """Any live node: the cluster client discovers the others from it."""
        return self.live()[0].url

    def node(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def view(self, via: RedisServer | None = None) -> list[NodeView]:
        """The cluster as one live node (by default the first) sees it."""
        with _client(via or self.live()[0]) as client:
            reported: dict[str, dict[str, Any]] = client.execute_command("CLUSTER NODES")
        out = []
        for addr, d in reported.items():
            flags = str(d["flags"]).split(",")
            slots: set[int] = set()
            for bounds in d["slots"]:
                first, last = int(bounds[0]), int(bounds[-1])
                slots.update(range(first, last + 1))
            out.append(
                NodeView(
                    port=int(addr.rsplit(":", 1)[1]),
                    node_id=str(d["node_id"]),
                    master="master" in flags,
                    failed="fail" in flags or "fail?" in flags,
                    master_id=str(d["master_id"]),
                    slots=frozenset(slots),
                )
            )
        return out

    def masters(self) -> list[RedisServer]:
        """Live masters that own slots, in port order."""
        return sorted(
            (self.node(v.port) for v in self.view() if v.master and v.slots and not v.failed),
            key=lambda node: node.port,
        )

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        seen = self.view()
        master_id = next(v.node_id for v in seen if v.port == master.port)
        return [self.node(v.port) for v in seen if v.master_id == master_id and not v.failed]

    def holder_of_slot(self, slot: int) -> RedisServer:
        """The master that owns `slot` now."""
        return self.node(next(v.port for v in self.view() if v.master and slot in v.slots))

    def holder_of_key(self, key: str) -> RedisServer:
        return self.holder_of_slot(key_slot(key.encode()))

    # -- faults ------------------------------------------------------------------------------

    def kill(self, node: RedisServer) -> None:
        """SIGKILL by pid: a crash, with no chance to hand its slots over."""
        node.stop(kill=True)

    def revive(self, node: RedisServer) -> None:
        """Start a killed node again on its port and directory; it rejoins, as a replica if a
        replica was promoted in its place."""
        node.start()
        self.wait_settled()

    # -- readiness -----------------------------------------------------------------------

    def wait_settled(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Until every live node says cluster_state:ok, sees every live node as up, agrees with
        the others on who owns every slot (a live master), and, if a replica, has its
        replication link up."""
        deadline = time.monotonic() + timeout_s
        last_problem = "not checked yet"
        while time.monotonic() < deadline:
            try:
                problem = self._settle_problem()
            except redis.RedisError as exc:
                problem = f"a node did not answer: {exc}"
            if problem is None:
                return
            last_problem = problem
            time.sleep(POLL_INTERVAL_S)
        raise RuntimeError(f"the cluster did not settle in {timeout_s} s: {last_problem}")

    def _settle_problem(self) -> str | None:
        live = self.live()
        live_ports = {node.port for node in live}
        owners: dict[int, int] | None = None
        for node in live:
            with _client(node) as client:
                info: dict[str, str] = client.execute_command("CLUSTER INFO")
                role = client.info("replication")
            if info.get("cluster_state") != "ok":
                return f"node {node.port} is in cluster_state {info.get('cluster_state')}"
            if role.get("role") == "slave" and role.get("master_link_status") != "up":
                return f"replica {node.port} has no link to its master yet"
            nodes_seen = self.view(via=node)
            if any(v.failed and v.port in live_ports for v in nodes_seen):
                return f"node {node.port} still sees a live node as failed"
            seen = {
                slot: v.port for v in nodes_seen if v.master and not v.failed for slot in v.slots
            }
            if len(seen) != SLOTS_COUNT:
                return f"node {node.port} sees {len(seen)} of {SLOTS_COUNT} slots owned"
            if not set(seen.values()) <= live_ports:
                return f"node {node.port} still routes slots to a dead node"
            if owners is not None and seen != owners:
                return f"node {node.port} disagrees about slot owners"
            owners = seen
        return None


def _client(node: RedisServer) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=node.port,
        decode_responses=True,
        socket_timeout=NODE_QUERY_TIMEOUT_S,
        socket_connect_timeout=NODE_QUERY_TIMEOUT_S,
    )
