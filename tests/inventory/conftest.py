"""Fixtures of the inventory tests that run a real sale writer."""

from __future__ import annotations

import pytest

from shop.processes.servers import SaleWriter as SaleWriterProcess
from tests.conftest import server_env, start_shop


@pytest.fixture(scope="module")
def writer_process(django_db_setup, django_db_blocker):
    """A real `manage.py sale writer` process for the module's tests."""
    writer = SaleWriterProcess(server_env()).start()
    yield writer
    writer.stop()


@pytest.fixture(scope="module")
def writer_shop(writer_process):
    """A real gunicorn whose web processes send their sales to `writer_process`."""
    server = start_shop(**writer_process.env())
    yield server
    server.stop()
