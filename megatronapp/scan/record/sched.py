"""What the operating system did to a rank's training thread: the scheduler's and the cgroup's
counters, read once at each traced iteration's start and end (their difference is recorded on
the iteration's span, see format.py).

- Run-queue delay: the 2nd field of `/proc/self/task/<tid>/schedstat`, nanoseconds the thread
  was runnable but not running (another process or thread had its core).
- Involuntary context switches of the thread: `getrusage(RUSAGE_THREAD).ru_nivcsw`.
- CPU throttling of the process's cgroup: `cpu.stat` of its cpu-controller cgroup, v1
  (`nr_throttled`, `throttled_time` in ns) or v2 (`nr_throttled`, `throttled_usec`).

Files are opened once and re-read with `pread` (a /proc or cgroupfs file is regenerated at
offset 0), so one sample costs a few microseconds. The process may be moved to another cgroup
while it runs (a CPU quota applied from outside): a sample re-reads /proc/self/cgroup (tens of
microseconds: the kernel formats every hierarchy) at most once per CGROUP_RECHECK_S and follows
a move, and a throttling difference across a move is unknown. A counter the machine does not
expose reads -1, and so does its difference.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

UNKNOWN = -1
CGROUP_RECHECK_S = 1.0
SIGNALS = ("run_delay_ns", "involuntary_switches", "throttled_ns", "nr_throttled")


def _cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller ("" for the v2 hierarchy) -> the process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def _cgroup_mounts(mountinfo: str) -> list[tuple[str, str, str]]:
    """(flavour "v1"/"v2", mount root, mount point) of each cgroup mount with the cpu controller
    (v1: "cpu" among the super options) or of the v2 hierarchy."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        root, point = fields[3], fields[4]
        fstype, _, options = line.split(" - ", 1)[1].split()[:3]
        if fstype == "cgroup" and "cpu" in options.split(","):
            mounts.append(("v1", root, point))
        elif fstype == "cgroup2":
            mounts.append(("v2", root, point))
    return mounts


def find_cpu_stat(proc_cgroup: str, mountinfo: str) -> tuple[str, Path] | None:
    """(flavour, path) of the `cpu.stat` of the cgroup the process is in now, v1 first; None if
    neither hierarchy has one."""
    paths = _cgroup_paths(proc_cgroup)
    for flavour, root, point in sorted(_cgroup_mounts(mountinfo)):
        own = paths.get("cpu" if flavour == "v1" else "")
        if own is None:
            continue
        inside = os.path.relpath(own, root) if own.startswith(root) else own.lstrip("/")
        path = Path(point) / inside / "cpu.stat"
        if path.is_file() and (flavour == "v1" or "throttled_usec" in path.read_text()):
            return flavour, path
    return None


def parse_cpu_stat(data: bytes, flavour: str) -> tuple[int, int]:
    """(throttled ns, times throttled) from a cpu.stat's bytes ("key value" lines)."""
    words = data.split()
    values = dict(zip(words[::2], words[1::2]))
    throttled = int(values[b"throttled_time"]) if flavour == "v1" else int(values[b"throttled_usec"]) * 1000
    return throttled, int(values[b"nr_throttled"])


def _open_or_none(path: str | Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


class SchedCounters:
    """Samples of SIGNALS for the calling thread and this process's cgroup; see the module docstring.

    The schedstat file follows the sampling thread: the thread that runs the training steps."""

    def __init__(self) -> None:
        self._tid = None
        self._schedstat: int | None = None
        self._proc_cgroup = _open_or_none("/proc/self/cgroup")
        self._cgroup_text = b""
        self._flavour: str | None = None
        self._cpu_stat: int | None = None
        self._generation = 0  # bumped at each move to another cgroup
        self._checked_at = -CGROUP_RECHECK_S

    def _follow_cgroup(self) -> None:
        """(Re)open the cpu.stat of the cgroup the process is in now, if it moved."""
        now = time.monotonic()
        if self._proc_cgroup is None or now - self._checked_at < CGROUP_RECHECK_S:
            return
        self._checked_at = now
        try:
            text = os.pread(self._proc_cgroup, 4096, 0)
            if text == self._cgroup_text:
                return
            self._cgroup_text = text
            found = find_cpu_stat(text.decode(), Path("/proc/self/mountinfo").read_text())
        except (OSError, ValueError):
            found = None
        if self._cpu_stat is not None:
            os.close(self._cpu_stat)
        self._flavour, self._cpu_stat = (found[0], _open_or_none(found[1])) if found else (None, None)
        self._generation += 1

    def _read_run_delay(self) -> int:
        tid = threading.get_native_id()
        if tid != self._tid:
            self.close_schedstat()
            self._tid, self._schedstat = tid, _open_or_none(f"/proc/self/task/{tid}/schedstat")
        if self._schedstat is None:
            return UNKNOWN
        try:
            return int(os.pread(self._schedstat, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return UNKNOWN

    def _read_throttling(self) -> tuple[int, int]:
        self._follow_cgroup()
        if self._cpu_stat is None:
            return UNKNOWN, UNKNOWN
        try:
            return parse_cpu_stat(os.pread(self._cpu_stat, 4096, 0), self._flavour)
        except (OSError, ValueError, KeyError):
            return UNKNOWN, UNKNOWN

    def sample(self) -> tuple[int, int, int, int, int]:
        """Cumulative counters now, in SIGNALS order (-1 where not exposed), then the cgroup's
        generation (see counter_deltas)."""
        switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        return (self._read_run_delay(), switches, *self._read_throttling(), self._generation)

    def close_schedstat(self) -> None:
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None

    def close(self) -> None:
        self.close_schedstat()
        for fd in (self._cpu_stat, self._proc_cgroup):
            if fd is not None:
                os.close(fd)
        self._cpu_stat = self._proc_cgroup = None


def counter_deltas(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...]:
    """after - before per counter of SIGNALS, from two SchedCounters.sample()s; -1 where either
    is unknown, and for the throttling pair when the process changed cgroup in between."""
    moved = before[-1] != after[-1]
    deltas = []
    for name, a, b in zip(SIGNALS, before, after):
        unknown = a < 0 or b < a or (moved and name in ("throttled_ns", "nr_throttled"))
        deltas.append(UNKNOWN if unknown else b - a)
    return tuple(deltas)
