"""A TCP proxy in front of a Redis that can lose one reply: the command runs on the server, and
the client never hears back (a reply lost to the network, or a client timeout too short)."""

from __future__ import annotations

import contextlib
import socket
import threading


class ReplyDroppingProxy:
    """Forwards every byte both ways between its clients and the Redis at `port`, except the
    next reply after `drop_next_reply()`, which it throws away."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._drop = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self.dropped = 0

    def __enter__(self) -> ReplyDroppingProxy:
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def drop_next_reply(self) -> None:
        self._drop.set()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
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
                if replies and self._drop.is_set():
                    self._drop.clear()
                    self.dropped += 1
                    continue
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
