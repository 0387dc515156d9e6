"""deploy/nginx.conf in front of a real gunicorn: slow clients tie up nginx, never a worker.

Runs the repository's own nginx.conf (its upstream and port pointed at this test's gunicorn)
with the machine's nginx; skipped where there is none (`make nginx` installs it, as CI does).
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from shop.processes.ports import free_port
from shop.processes.servers import ShopServer
from tests.conftest import server_env
from tests.support import NGINX, nginx_serving, nginx_site

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(NGINX is None, reason="no nginx on this machine (make nginx)"),
]

SLOW_CLIENTS = 8


@pytest.fixture
def gunicorn() -> Iterator[ShopServer]:
    # Two sync workers: a handful of slow clients is enough to take them all.
    server = ShopServer(env=server_env(), kind="sync", workers=2, threads=1).start()
    yield server
    server.stop()


@pytest.fixture
def proxy(gunicorn, tmp_path) -> Iterator[str]:
    port = free_port()
    with nginx_serving(nginx_site(gunicorn.port, port), tmp_path, port) as url:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # up once gunicorn answers through it
            if _answers_within(url, 2):
                break
            time.sleep(0.1)
        yield url


def _trickle(port: int) -> list[socket.socket]:
    """Clients that send the start of a request and then one header byte now and then."""
    clients = []
    for _ in range(SLOW_CLIENTS):
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        clients.append(client)
    return clients


def _answers_within(url: str, seconds: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=seconds) as response:
            return response.status == 200
    except OSError:
        return False


def test_slow_clients_take_gunicorn_but_not_the_proxy_in_front(gunicorn, proxy):
    # Straight at gunicorn, a few trickling clients hold every sync worker: nobody else gets in
    clients = _trickle(gunicorn.port)
    try:
        time.sleep(0.5)  # the trickle: a byte every half second
        for client in clients:
            client.sendall(b"x")
        assert not _answers_within(gunicorn.url, 3)
    finally:
        for client in clients:
            client.close()
    assert _answers_within(gunicorn.url, 10)  # they left: it answers again

    # Through the proxy, the same clients wait in nginx, which hands gunicorn whole requests
    clients = _trickle(int(proxy.rsplit(":", 1)[1]))
    try:
        time.sleep(0.5)  # the trickle: a byte every half second
        for _ in range(3):
            for client in clients:
                client.sendall(b"x")
            assert _answers_within(proxy, 3)
            time.sleep(0.5)
    finally:
        for client in clients:
            client.close()
