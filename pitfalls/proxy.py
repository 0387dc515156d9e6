"""A TCP proxy in front of a Redis that can lose what it carries: one reply (the command runs on
the server, the client never hears back), or everything from some moment on (a cut link, with
the connections still open, as a network partition leaves them)."""

from __future__ import annotations

import contextlib
import socket
import threading


class LossyProxy:
    """Forwards every byte both ways between its clients and the Redis at `port`, except the
    next reply after `drop_next_reply()`, and everything after `cut()`."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._drop = threading.Event()
        self._cut = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self.dropped = 0

    def __enter__(self) -> LossyProxy:
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def drop_next_reply(self) -> None:
        self._drop.set()

    def cut(self) -> None:
        """From now on nothing gets through, either way; the connections stay open."""
        self._cut.set()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                downstream.close()  # the server is gone: so is this connection
                continue
            with self._lock:
                self._sockets += [downstream, upstream]
            for source, sink, replies in (
                (downstream, upstream, False),
                (upstream, downstream, True),
            ):
                threading.Thread(
                    target=self._pump, args=(source, sink, replies), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if self._cut.is_set():
                    continue
                if replies and self._drop.is_set():
                    self._drop.clear()
                    self.dropped += 1
                    continue
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
