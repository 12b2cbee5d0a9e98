"""CPU faults the traced program cannot see: a cgroup CPU quota on a rank's process, a competing
busy process pinned to the rank's core, and a busy process on every core (noise, no fault).

Each fault is a context manager over live processes. `CpuQuota` writes the quota of a cgroup it
creates (v1 `cpu.cfs_quota_us` or v2 `cpu.max`, whichever the machine mounts with the cpu
controller), moves the rank's process into it and on exit moves it back and removes the
cgroup. `CompetingLoad` pins the rank (every thread) and a busy loop to the same core and kills
the loop on exit. A `Schedule` switches either on and off in the background (on_ms of every
period_ms) by rewriting the quota or by stopping and continuing the busy loop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

CGROUP_PREFIX = "mapplab-"
_V1_CPU = Path("/sys/fs/cgroup/cpu")
_V2_ROOT = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000
_BUSY_LOOP = "while True: pass"


@dataclass(frozen=True)
class Schedule:
    """Off for the first start_ms, then on for on_ms of every period_ms. A fault that starts mid-run
    is a late start with on_ms close to period_ms; one that stops is an on_ms shorter than the run
    and a period longer than it."""

    on_ms: int
    period_ms: int
    start_ms: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.on_ms < self.period_ms:
            raise ValueError(f"a schedule needs 0 < on_ms < period_ms, got {self.on_ms} of {self.period_ms} ms")
        if self.start_ms < 0:
            raise ValueError(f"a schedule's start_ms must be >= 0, got {self.start_ms}")


def cgroup_flavour() -> str | None:
    """'v1' or 'v2' where a cpu-controller cgroup can be made here, else None."""
    if (_V1_CPU / "cpu.cfs_quota_us").is_file() and os.access(_V1_CPU, os.W_OK):
        return "v1"
    controllers = _V2_ROOT / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split() and os.access(_V2_ROOT, os.W_OK):
        return "v2"
    return None


def _cgroup_of(pid: int, flavour: str) -> Path:
    """The cgroup directory `pid` is in now (to move it back on exit)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (flavour == "v1" and "cpu" in controllers.split(",")) or (flavour == "v2" and controllers == ""):
            return (_V1_CPU if flavour == "v1" else _V2_ROOT) / path.lstrip("/")
    return _V1_CPU if flavour == "v1" else _V2_ROOT


def _move(pid: int, cgroup: Path) -> None:
    try:
        (cgroup / "cgroup.procs").write_text(str(pid))
    except (ProcessLookupError, OSError):
        pass  # the process has exited: nothing to move


class CpuQuota:
    """`share` of one core for the processes `pids` (a cgroup CPU quota), optionally on a schedule."""

    def __init__(self, name: str, pids: list[int], share: float, schedule: Schedule | None = None) -> None:
        if not 0.01 <= share <= 1.0:
            raise ValueError(f"a CPU quota share must be in [0.01, 1] of one core, got {share}")
        flavour = cgroup_flavour()
        if flavour is None:
            raise OSError("no writable cgroup with the cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max)")
        self.flavour, self.pids, self.schedule = flavour, list(pids), schedule
        self.quota_us = int(share * _PERIOD_US)
        self.path = (_V1_CPU if flavour == "v1" else _V2_ROOT) / f"{CGROUP_PREFIX}{name}"
        self._origin: dict[int, Path] = {}
        self._toggler: _Toggler | None = None

    def _limit(self, on: bool) -> None:
        if self.flavour == "v1":
            (self.path / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(self.quota_us if on else -1))
        else:
            (self.path / "cpu.max").write_text(f"{self.quota_us if on else 'max'} {_PERIOD_US}")

    def __enter__(self) -> CpuQuota:
        self.path.mkdir(exist_ok=True)
        self._limit(not (self.schedule and self.schedule.start_ms))
        for pid in self.pids:
            self._origin[pid] = _cgroup_of(pid, self.flavour)
            _move(pid, self.path)
        self._toggler = _Toggler(self._limit, self.schedule)
        return self

    def __exit__(self, *exc) -> None:
        if self._toggler is not None:
            self._toggler.stop()
        for pid, origin in self._origin.items():
            _move(pid, origin)
        remove_cgroup(self.path)


class _Toggler:
    """A thread calling switch(True) for on_ms and switch(False) for the rest of each period of
    `schedule`, until stop(); no thread at all without a schedule."""

    def __init__(self, switch, schedule: Schedule | None):
        self._stop = threading.Event()
        self._thread = None
        if schedule is not None:
            self._thread = threading.Thread(target=self._run, args=(switch, schedule), daemon=True)
            self._thread.start()

    def _run(self, switch, schedule: Schedule) -> None:
        if schedule.start_ms:
            switch(False)
            if self._stop.wait(schedule.start_ms / 1000):
                return
        while not self._stop.is_set():
            switch(True)
            if self._stop.wait(schedule.on_ms / 1000):
                break
            switch(False)
            self._stop.wait((schedule.period_ms - schedule.on_ms) / 1000)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def remove_cgroup(path: Path) -> None:
    """Empty `path` into its parent and remove it (a cgroup with live processes cannot go)."""
    if not path.is_dir():
        return
    procs = path / "cgroup.procs"
    for pid in procs.read_text().split() if procs.is_file() else ():
        _move(int(pid), path.parent)
    try:
        path.rmdir()
    except OSError:
        pass


def lab_cores() -> list[int]:
    """The cores the lab may use: its own affinity (a lab started under `taskset` keeps to those
    cores, so several labs can share a machine without pinning onto each other's)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def start_busy_loop(core: int | None = None) -> subprocess.Popen:
    """A Python process spinning forever, pinned to `core` when given."""
    pin = ["taskset", "-c", str(core)] if core is not None else []
    return subprocess.Popen(
        [*pin, sys.executable, "-c", _BUSY_LOOP],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def pin_process(pid: int, core: int) -> None:
    """Every thread of `pid` to `core` (threads made later inherit their creator's mask)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {core})
        except (ProcessLookupError, OSError):
            pass


class CompetingLoad:
    """`loops` busy loops on the core the processes `pids` are pinned to, in one cgroup with them
    (where there is one), so the scheduler gives them about 1 / (loops + 1) of what the rank had:
    with autogroups (the Linux default) each session gets a fair share, and a rank in its own
    session would otherwise get half of its core whatever the number of loops in the lab's.
    Optionally on a schedule (SIGSTOP / SIGCONT)."""

    def __init__(self, name: str, pids: list[int], core: int, schedule: Schedule | None = None, loops: int = 1) -> None:
        if loops < 1:
            raise ValueError(f"a competing load needs >= 1 busy loop, got {loops}")
        self.name, self.pids, self.core, self.schedule, self.loops = name, list(pids), core, schedule, loops
        self._procs: list[subprocess.Popen] = []
        self._group: CpuQuota | None = None
        self._toggler: _Toggler | None = None

    def _switch(self, on: bool) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT if on else signal.SIGSTOP)

    def __enter__(self) -> CompetingLoad:
        for pid in self.pids:
            pin_process(pid, self.core)
        self._procs = [start_busy_loop(self.core) for _ in range(self.loops)]
        if cgroup_flavour() is not None:  # a whole core: the cgroup only groups, it does not limit
            self._group = CpuQuota(self.name, self.pids + [p.pid for p in self._procs], 1.0).__enter__()
        self._toggler = _Toggler(self._switch, self.schedule)
        return self

    def __exit__(self, *exc) -> None:
        if self._toggler is not None:
            self._toggler.stop()
        if self._group is not None:
            self._group.__exit__(None, None, None)
        for proc in self._procs:
            stop_process(proc)


def stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)  # a stopped process must run to take SIGKILL's exit path promptly
    proc.kill()
    proc.wait()


class BackgroundNoise:
    """One busy loop per core, unpinned: a loaded machine that slows every rank alike."""

    def __init__(self, per_core: int = 1) -> None:
        self.count = per_core * len(lab_cores())
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> BackgroundNoise:
        self._procs = [start_busy_loop() for _ in range(self.count)]
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            stop_process(p)


def cleanup_cgroups() -> list[str]:
    """Remove cgroups a killed lab left behind (names starting with CGROUP_PREFIX); their names."""
    gone = []
    for root in (_V1_CPU, _V2_ROOT):
        for path in root.glob(f"{CGROUP_PREFIX}*") if root.is_dir() else ():
            remove_cgroup(path)
            gone.append(str(path))
    return gone
