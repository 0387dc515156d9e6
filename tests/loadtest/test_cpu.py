"""The load run's CPU meter: real processes' CPU, read by part over a window."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from loadtest.cpu import PARTS, CpuMeter, _Sample, per_unit
from tests.conftest import wait_until

pytestmark = pytest.mark.skipif(not CpuMeter.available(), reason="needs /proc")

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass"


def _sampled_since(meter: CpuMeter, moment: float) -> bool:
    """Whether the meter has taken a sample wholly after `moment` (a Unix time): two samples
    stamped after it (a sample is stamped with the middle of its reading)."""
    return sum(sample.at > moment for sample in list(meter.samples)) >= 2


def test_a_process_and_its_children_are_counted_in_their_part_over_a_window():
    # Given a meter that knows a process as the server, started before the process burns CPU
    meter = CpuMeter(interval=0.05)
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"child = subprocess.Popen([sys.executable, '-c', {BURN.format(seconds=0.4)!r}])\n"
         f"exec({BURN.format(seconds=0.3)!r})\n"
         "child.wait()"]
    )  # fmt: skip
    meter.track(parent.pid, "server")
    meter.start()
    started = time.time()

    # When it and the child it starts burn 0.3 s and 0.4 s of CPU, and the meter has sampled
    # since (the window's end then reads a sample taken after the burn, not a mix with one
    # taken during it)
    parent.wait(timeout=30)
    exited = time.time()
    assert wait_until(lambda: _sampled_since(meter, exited), timeout=10, interval=0.01)
    ended = time.time()
    meter.stop()

    # Then the window holds both, in the server's part, and the host's busy CPU holds them too
    cpu = meter.between(started, ended)
    assert cpu is not None
    server = cpu["cpu_seconds"]["server"]
    assert 0.6 <= server <= 0.9, cpu
    assert cpu["busy_cpu_seconds"] >= server * 0.95
    assert 0 < cpu["host_busy"] <= 1
    # and parts nothing ran for are not measured, rather than measured as zero
    assert cpu["cpu_seconds"]["locust"] is None and cpu["cpu_seconds"]["worker"] is None
    # and nothing outside the samples is read
    assert meter.between(started - 60, ended) is None


@pytest.mark.parametrize("server_exits", [False, True], ids=["server-lives-on", "server-exits"])
def test_what_is_spent_between_two_samples_counts_once_reaped(server_exits):
    # Given a meter that samples only when told, and a server that starts a child and reaps it,
    # then lives on or exits (reaped by this process)
    meter = CpuMeter(interval=3600)
    then = "sys.exit(0)" if server_exits else "time.sleep(60)"
    server = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"subprocess.run([sys.executable, '-c', {BURN.format(seconds=0.4)!r}])\n"
         "print('reaped', flush=True)\n"
         f"{then}"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        meter.track(server.pid, "server")
        meter.start()
        started = time.time()

        # When the child burns 0.4 s of CPU and is gone before the next sample
        assert server.stdout.readline().strip() == "reaped"
        if server_exits:
            server.wait(timeout=30)
        ended = time.time()
        meter.stop()
    finally:
        server.kill()
        server.wait()

    # Then its CPU is counted all the same, in the server's part, from the reaper's children's
    # times
    cpu = meter.between(started, ended)
    assert cpu is not None
    assert 0.35 <= cpu["cpu_seconds"]["server"] <= 0.7, cpu


def test_a_window_between_two_samples_is_read_linearly_and_the_rest_is_other():
    meter = CpuMeter()
    meter._seen = {"server", "locust"}
    zero = dict.fromkeys(PARTS, 0.0)
    meter.samples = [
        _Sample(100.0, {**zero}, busy=0.0, total=0.0),
        _Sample(101.0, {**zero, "server": 1.0, "locust": 0.4}, busy=1.8, total=2.0),
        _Sample(102.0, {**zero, "server": 1.2, "locust": 0.8}, busy=2.4, total=4.0),
    ]

    cpu = meter.between(100.5, 101.5)

    assert cpu["seconds"] == 1.0
    assert cpu["cpu_seconds"]["server"] == pytest.approx(0.6)
    assert cpu["cpu_seconds"]["locust"] == pytest.approx(0.4)
    assert cpu["cpu_seconds"]["other"] == pytest.approx(1.2 - 1.0)  # busy 0.9 -> 2.1
    assert cpu["host_busy"] == pytest.approx(1.2 / 2.0)
    assert cpu["cpu_seconds"]["postgres"] is None
    # per unit: milliseconds of each part, and of the host's busy CPU in all
    costs = per_unit(cpu, 400)
    assert costs["server"] == pytest.approx(1.5) and costs["all"] == pytest.approx(3.0)
    assert costs["postgres"] is None
    assert per_unit(cpu, 0) == {} and per_unit(None, 10) == {}
