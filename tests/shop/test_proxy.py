"""deploy/nginx.conf in front of a real server: slow clients tie up nginx, never a worker; and
as compose runs it, in front of granian on the unix socket its workers share.

Runs the repository's own nginx.conf (its upstream and port pointed at this test's server)
with the machine's nginx; skipped where there is none (`make nginx` installs it, as CI does).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from shop.processes.ports import free_port
from shop.processes.servers import PROJECT_DIR, ShopServer
from tests.conftest import TEST_API_TOKEN, server_env
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
    with nginx_serving(nginx_site(f"127.0.0.1:{gunicorn.port}", port), tmp_path, port) as url:
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


def _compose_web() -> dict:
    return yaml.safe_load((PROJECT_DIR / "docker-compose.yml").read_text())["services"]["web"]


def _web_healthcheck(socket_path: Path) -> list[str]:
    """docker-compose.yml's healthcheck of web, pointed at `socket_path`."""
    command, python, flag, script = _compose_web()["healthcheck"]["test"]
    assert (command, python, flag) == ("CMD", "python", "-c")
    assert script.count("/run/flashsale/web.sock") == 1
    return [sys.executable, "-c", script.replace("/run/flashsale/web.sock", str(socket_path))]


def test_compose_shape_granian_on_a_shared_socket_behind_nginx(tmp_path):
    # Given granian on a unix socket, as compose's web runs it (its hosts too: the metrics port
    # asks for `web`), and deploy/nginx.conf in front
    socket_path = tmp_path / "web.sock"
    hosts = _compose_web()["environment"]["DJANGO_ALLOWED_HOSTS"]
    server = ShopServer(env=server_env(DJANGO_ALLOWED_HOSTS=hosts), uds=socket_path).start()
    try:
        site = nginx_site(f"unix:{socket_path}", port := free_port())
        (metrics_port,) = map(int, re.findall(r"listen 127\.0\.0\.1:(\d+);", site)[1:])
        with nginx_serving(site, tmp_path, port) as url:
            # Then the shop answers through it, and compose's healthcheck of web passes
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
                assert json.loads(response.read())["ok"] is True
            assert subprocess.run(_web_healthcheck(socket_path), timeout=30).returncode == 0
            # and /metrics is kept in on the public port, served with the token on the other
            with pytest.raises(urllib.error.HTTPError) as public:
                urllib.request.urlopen(f"{url}/metrics", timeout=5)
            assert public.value.code == 404
            scrape = urllib.request.Request(
                f"http://127.0.0.1:{metrics_port}/metrics",
                headers={"Authorization": f"Bearer {TEST_API_TOKEN}"},
            )
            with urllib.request.urlopen(scrape, timeout=5) as response:
                assert b"# TYPE flashsale_orders gauge" in response.read()
            # and with the web server gone, a checkout is answered JSON 502, no Retry-After
            server.stop()
            checkout = urllib.request.Request(
                f"{url}/api/checkout",
                data=json.dumps({"sku": "gone", "qty": 1, "buyer": "b"}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as gone:
                urllib.request.urlopen(checkout, timeout=5)
            assert gone.value.code == 502 and gone.value.headers["Retry-After"] is None
            assert json.loads(gone.value.read())["error"] == "bad_gateway"
            assert subprocess.run(_web_healthcheck(socket_path), timeout=30).returncode != 0
    finally:
        server.stop()
