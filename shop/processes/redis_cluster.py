"""A real Redis Cluster on 127.0.0.1, for tests and benchmarks: `masters` primaries with
`replicas` replicas each, every node a `RedisServer` of its own (`shop.processes.redis_server`)
started with cluster mode on, joined and given its slots with CLUSTER commands.

    with LocalCluster(masters=3, replicas=1) as cluster:
        client = cluster.client()            # a redis.cluster.RedisCluster
        os.environ["REDIS_CLUSTER_NODES"] = cluster.nodes_setting
        cluster.kill_master_of("some-key")   # SIGKILL; its replica is promoted
        cluster.wait_for_failover(...)

A node's cluster bus listens on its port + 10000, so ports are picked below 55536 with both
free. Nodes persist nothing but their `nodes.conf` (in their own directory), so a killed node
restarted on its port rejoins the cluster as the replica of whoever took its slots.
"""

from __future__ import annotations

import random
import socket
import time
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from .redis_server import RedisServer, RedisServerError

__all__ = ["LocalCluster"]

SLOTS = 16384
_BUS_OFFSET = 10000


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(count: int) -> list[int]:
    """`count` ports below 55536 whose cluster bus ports (+10000) are free too."""
    picked: list[int] = []
    while len(picked) < count:
        port = random.randrange(20000, 55535)
        if port in picked or port + _BUS_OFFSET in picked:
            continue
        if _free(port) and _free(port + _BUS_OFFSET):
            picked.append(port)
    return picked


class LocalCluster:
    """`masters` x (1 + `replicas`) redis-server processes formed into one cluster."""

    def __init__(self, masters: int = 3, replicas: int = 1, *, node_timeout_ms: int = 1000) -> None:
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters to fail over")
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []

    # -- addresses -------------------------------------------------------------------

    @property
    def nodes_setting(self) -> str:
        """The value of REDIS_CLUSTER_NODES: every node's host:port."""
        return ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def client(self, **kwargs: Any) -> RedisCluster:
        """A new RedisCluster over every node, no retries (as the shop builds it)."""
        kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        kwargs.setdefault("socket_connect_timeout", 1.0)
        kwargs.setdefault("socket_timeout", 1.0)
        return RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", node.port) for node in self.nodes],
            **kwargs,
        )

    def node_client(self, node: RedisServer) -> redis.Redis:
        return node.client(socket_timeout=1.0)

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> LocalCluster:
        count = self.masters * (1 + self.replicas)
        for attempt in range(3):
            ports = cluster_ports(count)
            try:
                self.nodes = [self._node(port) for port in ports]
                for node in self.nodes:
                    node.start()
                break
            except RedisServerError:
                self.stop()
                if attempt == 2:
                    raise
        self._form()
        return self

    def _node(self, port: int) -> RedisServer:
        return RedisServer(
            port,
            args=[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                # A replica always stands in for its dead master, however long its link was
                # down; the cluster serves the slots it still has while one is uncovered.
                "--cluster-replica-validity-factor",
                "0",
                "--cluster-require-full-coverage",
                "no",
            ],
        )

    def _form(self) -> None:
        clients = [self.node_client(node) for node in self.nodes]
        try:
            first = clients[0]
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            per_master = SLOTS // self.masters
            for index in range(self.masters):
                low = index * per_master
                high = SLOTS if index == self.masters - 1 else low + per_master
                clients[index].execute_command("CLUSTER", "ADDSLOTS", *range(low, high))
            ids = [client.execute_command("CLUSTER", "MYID") for client in clients]
            self._wait(lambda: all(self._knows_all(c, len(ids)) for c in clients), "the meet")
            for replica, client in enumerate(clients[self.masters :]):
                master_id = ids[replica % self.masters]
                self._wait(
                    lambda c=client, m=master_id: self._replicate(c, m), "the replicas to attach"
                )
            self._wait(self.healthy, "the cluster to be ok")
        finally:
            for client in clients:
                client.close()

    @staticmethod
    def _knows_all(client: redis.Redis, count: int) -> bool:
        lines = _text(client.execute_command("CLUSTER", "NODES")).splitlines()
        return len(lines) == count and not any("handshake" in line for line in lines)

    @staticmethod
    def _replicate(client: redis.Redis, master_id: Any) -> bool:
        try:
            client.execute_command("CLUSTER", "REPLICATE", _text(master_id))
        except redis.ResponseError:
            return False  # the master is not known as such yet
        return True

    def healthy(self) -> bool:
        """Every running node says cluster_state:ok and every slot is served by a master
        that answers."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                info = _text(self.node_client(node).execute_command("CLUSTER", "INFO"))
            except redis.RedisError:
                return False
            if "cluster_state:ok" not in info or f"cluster_slots_ok:{SLOTS}" not in info:
                return False
        return True

    def _wait(self, condition, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise RedisServerError(f"the local cluster timed out waiting for {what}")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- who serves what, and failures -----------------------------------------------

    def master_ports(self) -> set[int]:
        """The ports of the nodes serving slots now."""
        client = self.client()
        try:
            return {int(node.port) for node in client.get_primaries()}
        finally:
            client.close()

    def port_of(self, key: str) -> int:
        """The port of the master serving `key`'s slot now."""
        client = self.client()
        try:
            return int(client.get_node_from_key(key).port)
        finally:
            client.close()

    def node_on(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def kill_master_of(self, key: str) -> RedisServer:
        """SIGKILL the master serving `key`; returns it (restart() makes it a replica)."""
        node = self.node_on(self.port_of(key))
        node.kill()
        return node

    def wait_for_failover(self, dead: RedisServer, timeout: float = 30.0) -> None:
        """Until a replica serves the dead master's slots and the cluster is ok again."""

        def promoted() -> bool:
            try:
                return dead.port not in self.master_ports() and self.healthy()
            except (redis.RedisError, IndexError, KeyError):
                return False

        self._wait(promoted, "a replica to take over", timeout)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def main(argv: list[str] | None = None) -> int:
    """`python -m shop.processes.redis_cluster [--masters N] [--replicas R] -- CMD ...`: run CMD
    with REDIS_CLUSTER_NODES naming a local cluster started for it, stopped afterwards."""
    import argparse
    import os
    import subprocess
    import sys

    parser = argparse.ArgumentParser(prog="python -m shop.processes.redis_cluster")
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser.error("name the command to run after --")
    if options.masters < 3 or options.replicas < 0:
        parser.error("--masters must be at least 3 and --replicas at least 0")
    with LocalCluster(options.masters, options.replicas) as cluster:
        print(f"REDIS_CLUSTER_NODES={cluster.nodes_setting}", file=sys.stderr, flush=True)
        env = {**os.environ, "REDIS_CLUSTER_NODES": cluster.nodes_setting}
        return subprocess.call(command, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
