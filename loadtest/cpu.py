"""Where a load run's CPU goes: each part of the system's CPU per unit sold over a window.

On a few cores the rate a strategy sells at is set by the CPU a unit costs, and most of that is
not the strategy's: the server, the crowd and the order worker share the cores. A `CpuMeter`
samples, four times a second, the CPU time (user + system) of this host's processes by part
(`PARTS`); `between` reads each part's CPU over a window off the samples.

Invariants: the parts add up to what the host's CPUs did (`other` is the rest of the busy CPU,
read from /proc/stat); a process counts from when the meter first sees it, and what it spent
after its last sample counts, in its own part, once its parent reaps it. Linux only (/proc):
elsewhere `CpuMeter.between` returns None. See docs/load-runs.md#where-the-cpu-went.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from dataclasses import dataclass, field

from .bench.measure import host_cpu_times

#: The parts, in the order the report prints them: `server`, the web server started for the run
#: and its workers; `worker`, the Celery worker; `locust`, the run's Locust processes;
#: `postgres` and `redis`, every process of that name on this host (`BY_NAME`: a server elsewhere
#: counts nothing here); `other`, the rest of the host's busy CPU (this process, the broker,
#: the kernel's threads).
PARTS = ("server", "worker", "locust", "postgres", "redis", "other")
#: Parts told apart by the name of the process (its `comm`).
BY_NAME = {"postgres": "postgres", "redis-server": "redis"}
INTERVAL = 0.25


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


#: pid: (name, parent pid, its own CPU jiffies, those of the children it reaped).
_Processes = dict[int, tuple[str, int, int, int]]


def _processes() -> _Processes:
    """Every process on this host."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                line = stat.read()
        except OSError:
            continue  # gone meanwhile
        name = line[line.index("(") + 1 : line.rindex(")")]
        rest = line[line.rindex(")") + 2 :].split()
        own = int(rest[11]) + int(rest[12])
        found[int(entry)] = (name, int(rest[1]), own, int(rest[13]) + int(rest[14]))
    return found


@dataclass
class _Sample:
    at: float  # time.time()
    seconds: dict[str, float]  # part: CPU seconds since the meter started
    busy: float  # host busy CPU seconds since the meter started
    total: float  # host CPU seconds (busy and idle) since the meter started


@dataclass
class CpuMeter:
    """Samples CPU by part from `start()` to `stop()`; `roots` maps a process (pid) to the
    part it and its descendants belong to, and `track` adds one while the meter runs."""

    roots: dict[int, str] = field(default_factory=dict)
    interval: float = INTERVAL
    samples: list[_Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # At each process's last sample: its jiffies (its own, its reaped children's), its
        # parent and its part.
        self._last: dict[int, tuple[int, int]] = {}
        self._parents: dict[int, int] = {}
        self._part: dict[int, str | None] = {}
        self._parts: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._seen: set[str] = set()  # parts some process was found for
        self._host0: tuple[float, float] | None = None

    @staticmethod
    def available() -> bool:
        return host_cpu_times() is not None

    def track(self, pid: int, part: str) -> None:
        with self._lock:
            self.roots[pid] = part

    def start(self) -> CpuMeter:
        if not self.available():
            return self
        before = self._instant()
        self._host0 = before[1]
        processes = _processes()
        with self._lock:
            roots = dict(self.roots)
        self._remember(processes, {pid: self._part_of(pid, processes, roots) for pid in processes})
        self._record(before)
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.sample()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """Take one sample now (the thread does every `interval`)."""
        before = self._instant()
        processes = _processes()
        with self._lock:
            roots = dict(self.roots)
        parts = {pid: self._part_of(pid, processes, roots) for pid in processes}
        # A process gone since the last sample was reaped: what it spent after that sample
        # shows in its reaper's children's jiffies (a reaper gone too hands it on to its own).
        reaped: dict[int, list[int]] = {}
        for pid in self._last:
            if pid in processes:
                continue
            reaper = self._parents.get(pid, 0)
            hops = 0
            while reaper not in processes and reaper in self._parents and hops < 64:
                reaper = self._parents[reaper]
                hops += 1
            reaped.setdefault(reaper, []).append(pid)
        for pid, (_, _, own, children) in processes.items():
            last_own, last_children = self._last.get(pid, (0, 0))
            self._add(parts[pid], own - last_own)
            grown = children - last_children
            gone = reaped.get(pid)
            if not gone:
                self._add(parts[pid], grown)  # children that came and went between samples
                continue
            # Counted in their own part, less what was counted of them already.
            remainder = grown - sum(sum(self._last[child]) for child in gone)
            gone_parts = {self._part.get(child) for child in gone}
            self._add(gone_parts.pop() if len(gone_parts) == 1 else parts[pid], remainder)
        self._remember(processes, parts)
        self._record(before)

    def _add(self, part: str | None, jiffies: int) -> None:
        if part is not None and jiffies > 0:
            self._parts[part] += jiffies / _ticks()
            self._seen.add(part)

    def _remember(self, processes: _Processes, parts: dict[int, str | None]) -> None:
        self._last = {pid: (own, children) for pid, (_, _, own, children) in processes.items()}
        self._parents = {pid: parent for pid, (_, parent, _, _) in processes.items()}
        self._part = parts

    @staticmethod
    def _part_of(pid: int, processes: _Processes, roots: dict[int, str]) -> str | None:
        name = processes[pid][0]
        if name in BY_NAME:
            return BY_NAME[name]
        hops = 0
        while pid in processes and hops < 64:
            if pid in roots:
                return roots[pid]
            pid = processes[pid][1]
            hops += 1
        return None

    @staticmethod
    def _instant() -> tuple[float, tuple[float, float] | None]:
        return time.time(), host_cpu_times()

    def _record(self, before: tuple[float, tuple[float, float] | None]) -> None:
        """Records the parts as read by the scan that started at `before`. The scan of /proc
        takes a while on a busy host, so the host's CPU and the time are those halfway
        through it, the mean of the readings before and after it."""
        at, host = before
        after_at, after_host = self._instant()
        if host is None or after_host is None or self._host0 is None:
            return
        busy = ((host[0] + after_host[0]) / 2 - self._host0[0]) / _ticks()
        total = ((host[1] + after_host[1]) / 2 - self._host0[1]) / _ticks()
        self.samples.append(_Sample((at + after_at) / 2, dict(self._parts), busy, total))

    def between(self, start: float, end: float) -> dict[str, object] | None:
        """CPU seconds by part from `start` to `end` (Unix times), read off the samples
        (linearly between two of them), with `other`, `busy` (all the host's busy CPU) and
        `host_busy` (its share of the host's CPUs). None when the samples do not cover the
        window. Parts no process was found for are None."""
        if len(self.samples) < 2 or end <= start:
            return None
        if start < self.samples[0].at - self.interval or end > self.samples[-1].at + self.interval:
            return None
        before, after = self._at(start), self._at(end)
        seconds: dict[str, float | None] = {}
        for part in PARTS[:-1]:
            spent = after.seconds[part] - before.seconds[part]
            seconds[part] = max(spent, 0.0) if part in self._seen else None
        busy = after.busy - before.busy
        total = after.total - before.total
        counted = sum(value for value in seconds.values() if value is not None)
        seconds["other"] = max(busy - counted, 0.0)
        return {
            "seconds": round(end - start, 3),
            "cpu_seconds": {part: _round(value) for part, value in seconds.items()},
            "busy_cpu_seconds": round(busy, 4),
            "host_busy": round(busy / total, 3) if total > 0 else None,
            "cores": os.cpu_count(),
        }

    def _at(self, moment: float) -> _Sample:
        """The samples' reading at `moment`, linearly between the two around it."""
        times = [sample.at for sample in self.samples]
        index = bisect.bisect_left(times, moment)
        if index <= 0:
            return self.samples[0]
        if index >= len(self.samples):
            return self.samples[-1]
        low, high = self.samples[index - 1], self.samples[index]
        share = (moment - low.at) / (high.at - low.at) if high.at > low.at else 0.0

        def mix(a: float, b: float) -> float:
            return a + (b - a) * share

        return _Sample(
            moment,
            {part: mix(low.seconds[part], high.seconds[part]) for part in low.seconds},
            mix(low.busy, high.busy),
            mix(low.total, high.total),
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def per_unit(cpu: dict[str, object] | None, units: float) -> dict[str, float | None]:
    """Milliseconds of CPU per unit by part (and `all`: the host's busy CPU), from `between`."""
    if not cpu or units <= 0:
        return {}
    seconds = cpu["cpu_seconds"]
    assert isinstance(seconds, dict)
    result: dict[str, float | None] = {
        part: None if seconds.get(part) is None else round(seconds[part] * 1000 / units, 3)
        for part in PARTS
    }
    busy = cpu["busy_cpu_seconds"]
    assert isinstance(busy, float)
    result["all"] = round(busy * 1000 / units, 3)
    return result
