"""`python -m loadtest.latency_proxy`: relays TCP connections to a server, every byte delayed by
a fixed time each way, in order; refuses bad arguments and a port already taken."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from shop.processes.ports import free_port


@contextmanager
def echo_server() -> Iterator[int]:
    """A TCP server on this host that sends back what it reads, until its client closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def _command(listen: int, target_port: int, delay_ms: float) -> list[str]:
    return [
        *(sys.executable, "-m", "loadtest.latency_proxy"),
        *("--listen", str(listen), "--to", f"127.0.0.1:{target_port}"),
        *("--delay-ms", str(delay_ms)),
    ]


@contextmanager
def proxy(target_port: int, delay_ms: float) -> Iterator[int]:
    port = free_port()
    process = subprocess.Popen(
        _command(port, target_port, delay_ms), stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert "relaying" in process.stdout.readline()
        yield port
    finally:
        process.terminate()
        process.wait(10)


def _round_trip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    received = b""
    while len(received) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "the proxy closed the connection"
        received += chunk
    return received


def test_the_proxy_relays_every_byte_in_order_each_way_later_by_its_delay():
    with echo_server() as target, proxy(target, delay_ms=25) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            # A round trip through it takes at least twice the delay
            for _ in range(3):
                started = time.perf_counter()
                assert _round_trip(sock, b"ping") == b"ping"
                assert time.perf_counter() - started >= 0.050
            # and a megabyte comes back whole and in order
            payload = bytes(range(256)) * 4096
            assert _round_trip(sock, payload) == payload
            # and when the client is done, the server's close reaches it
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(1) == b""


def test_a_proxy_whose_target_is_down_closes_the_client_s_connection():
    with proxy(free_port(), delay_ms=0) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert sock.recv(1) == b""


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--listen", "0", "--to", "127.0.0.1:5432", "--delay-ms", "1"], "is not a port"),
        (["--listen", "5", "--to", "nowhere", "--delay-ms", "1"], "is not host:port"),
        (["--listen", "5", "--to", "h:70000", "--delay-ms", "1"], "is not host:port"),
        (["--listen", "5", "--to", "h:1", "--delay-ms", "-1"], "from 0 to 1000 ms"),
        (["--listen", "5", "--to", "h:1", "--delay-ms", "soon"], "is not a number"),
        (["--to", "h:1", "--delay-ms", "1"], "--listen"),
    ],
)
def test_the_proxy_refuses_bad_arguments(args, complaint):
    result = subprocess.run(
        [sys.executable, "-m", "loadtest.latency_proxy", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert complaint in result.stderr


def test_the_proxy_says_when_its_port_is_taken():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(_command(port, 1, 1), capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
