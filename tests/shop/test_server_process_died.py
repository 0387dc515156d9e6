"""A server of the shop whose main process died (granian's, SIGKILLed): its workers go on
serving until the server is stopped, which stops them too, and a server starts again on the
unix socket it left behind."""

from __future__ import annotations

import psutil
import pytest

from shop.processes.servers import ShopServer
from tests.conftest import server_env, wait_until
from tests.support import gone

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_server_whose_main_process_died_leaves_no_worker_behind(tmp_path):
    # Given the shop under granian on a unix socket, as compose runs it
    server = ShopServer(env=server_env(), uds=tmp_path / "web.sock").start()
    again = None
    try:
        assert server.process is not None
        main = psutil.Process(server.process.pid)
        workers = main.children(recursive=True)
        assert workers

        # When its main process is killed (SIGKILL: no goodbye)
        main.kill()
        server.process.wait()

        # Then its workers go on serving
        assert server.healthz_status() == 200
        assert not any(gone(worker) for worker in workers)

        # and stopping the server stops them
        server.stop()
        assert wait_until(lambda: all(gone(worker) for worker in workers), timeout=10)

        # and a server starts again on the socket file the dead one left behind
        again = ShopServer(env=server_env(), uds=tmp_path / "web.sock").start()
        assert again.healthz_status() == 200
    finally:
        server.stop()
        if again is not None:
            again.stop()
