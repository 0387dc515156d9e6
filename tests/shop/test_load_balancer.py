"""deploy/nginx-cluster.conf spreads requests over every web replica Docker's DNS names.

Runs the repository's own file with the machine's nginx (`make nginx` installs it), its
compose-only parts pointed at this test: the resolver at a small DNS server that answers `web`
as Docker's would for scaled replicas (one address each: 127.0.0.1, .2, .3 on one port), the
replicas' port and nginx's own. Skipped where there is no nginx.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shop.processes.ports import free_port
from tests.support import NGINX, nginx_serving

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
REQUESTS = 40

pytestmark = pytest.mark.skipif(NGINX is None, reason="no nginx on this machine (make nginx)")


class ServiceDns:
    """A DNS server on 127.0.0.1 answering A queries for one name with the addresses it is
    given now (Docker's DNS, for a service and its replicas); any other name does not exist."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.addresses: list[str] = []
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.settimeout(0.2)
        self.port = self.socket.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> ServiceDns:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stopped.set()
        self._thread.join(5)
        self.socket.close()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                query, client = self.socket.recvfrom(512)
            except TimeoutError:
                continue
            self.socket.sendto(self._answer(query), client)

    def _answer(self, query: bytes) -> bytes:
        (ident,) = struct.unpack("!H", query[:2])
        labels, offset = [], 12
        while query[offset]:
            length = query[offset]
            labels.append(query[offset + 1 : offset + 1 + length].decode())
            offset += 1 + length
        qtype, _qclass = struct.unpack("!HH", query[offset + 1 : offset + 5])
        question = query[12 : offset + 5]
        known = ".".join(labels).lower() == self.name
        addresses = list(self.addresses) if known and qtype == 1 else []
        flags = 0x8180 if known else 0x8183  # a response, recursion available; NXDOMAIN
        header = struct.pack("!HHHHHH", ident, flags, 1, len(addresses), 0, 0)
        answers = b"".join(
            struct.pack("!HHHIH", 0xC00C, 1, 1, 1, 4) + socket.inet_aton(address)
            for address in addresses
        )
        return header + question + answers


class Replica(BaseHTTPRequestHandler):
    """Answers every GET with the address it listens on, and counts it."""

    def do_GET(self) -> None:
        address = self.server.server_address[0]
        self.server.hits[address] += 1
        body = address.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:
        pass


def _replicas_on_one_port() -> list[ThreadingHTTPServer]:
    """One server per replica address, all on one port (as the replicas of a service are)."""
    for _ in range(20):
        port = free_port()
        servers: list[ThreadingHTTPServer] = []
        try:
            for address in REPLICAS:
                server = ThreadingHTTPServer((address, port), Replica)
                server.hits = Counter()
                servers.append(server)
        except OSError:
            for server in servers:
                server.server_close()
            continue
        return servers
    pytest.fail("no port free on every replica address")


@pytest.fixture
def replicas() -> Iterator[dict[str, ThreadingHTTPServer]]:
    servers = _replicas_on_one_port()
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {server.server_address[0]: server for server in servers}
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def dns() -> Iterator[ServiceDns]:
    with ServiceDns("web") as server:
        yield server


@pytest.fixture
def balancer(replicas, dns, tmp_path) -> Iterator[tuple[str, float]]:
    """nginx on deploy/nginx-cluster.conf; yields its URL and how long it keeps an answer."""
    port = free_port()
    replica_port = next(iter(replicas.values())).server_address[1]
    site = (ROOT / "deploy" / "nginx-cluster.conf").read_text()
    valid = re.search(r"resolver 127\.0\.0\.11 valid=(\d+)s", site)
    site, resolvers = re.subn(r"resolver 127\.0\.0\.11 ", f"resolver 127.0.0.1:{dns.port} ", site)
    site, upstreams = re.subn(r"(?m)^(\s*set \$\w+ web):8000;", rf"\1:{replica_port};", site)
    site, listens = re.subn(r"listen 80;", f"listen 127.0.0.1:{port};", site)
    site, metrics = re.subn(r"listen 9000;", f"listen 127.0.0.1:{free_port()};", site)
    assert valid and resolvers == listens == metrics == 1 and upstreams == 2, (
        "deploy/nginx-cluster.conf changed shape: update this test"
    )
    with nginx_serving(site, tmp_path, port) as url:
        yield url, float(valid.group(1))


def _spread(url: str, count: int = REQUESTS) -> Counter:
    """Which replica answered each of `count` requests through the balancer."""
    answered: Counter = Counter()
    for _ in range(count):
        with urllib.request.urlopen(f"{url}/api/items/phone", timeout=10) as response:
            assert response.status == 200
            answered[response.read().decode()] += 1
    return answered


def test_requests_reach_every_replica_and_a_scaled_up_one_within_the_dns_validity(
    balancer, replicas, dns
):
    url, valid_seconds = balancer
    # given two replicas of web
    dns.addresses = ["127.0.0.1", "127.0.0.2"]
    # when requests come through the balancer, then both replicas serve them
    assert set(_spread(url)) == {"127.0.0.1", "127.0.0.2"}

    # given a third replica (`--scale web=3`) while nginx runs
    dns.addresses = list(REPLICAS)
    # then it gets requests once the cached answer expires, without restarting nginx
    deadline = time.monotonic() + valid_seconds + 5
    while replicas["127.0.0.3"].hits["127.0.0.3"] == 0:
        assert time.monotonic() < deadline, "the new replica got no request"
        _spread(url, 5)
    assert set(_spread(url)) == set(REPLICAS)


def test_a_replica_that_is_gone_costs_no_request(balancer, replicas, dns):
    url, _valid = balancer
    dns.addresses = list(REPLICAS)
    # given a replica that stopped while Docker's DNS (or nginx's cache of it) still names it
    replicas["127.0.0.2"].shutdown()
    replicas["127.0.0.2"].server_close()
    # then every request is answered by the others: nginx tries the next address
    assert set(_spread(url)) == {"127.0.0.1", "127.0.0.3"}
