"""Run a LabPlan: launch the job, find its rank processes, break the machine under them, tear down.

Order: background noise first (it loads the machine the job starts on), then the namespaces
(nodes mode), then the launcher(s). Once every rank's process exists (found by the RANK variable
torchrun gives it, among the launchers' descendants), the CPU faults are put on those processes
and the link limits on the source rank's namespace; then the lab waits for the job under a hard
timeout that kills every descendant. Every fault is undone in `finally`, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import megatronapp.faultlab.cpu as cpu
import megatronapp.faultlab.net as net
from megatronapp.faultlab.plan import (
    LabPlan,
    Noise,
    ScriptJob,
    SlowLink,
    SlowRank,
    fault_env,
    local_command,
    node_command,
    node_env,
)
from megatronapp.scan.probe_config import PROBE_FILE
from megatronapp.scan.record.autotrace import AutoTraceConfig

_STRIP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


@dataclass(frozen=True)
class LabResult:
    returncode: int  # 0: every launcher exited cleanly; -1: timed out
    trace_dir: Path  # every rank's file (nodes mode: gathered from the nodes' own directories)
    seconds: float
    applied: tuple[str, ...]  # each fault as installed, in words
    log: Path


def _descendants(pids: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], list(pids)
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def find_rank_pids(launchers: list[int]) -> dict[int, int]:
    """rank -> pid of the worker process torchrun started for it (its RANK variable)."""
    found = {}
    for pid in _descendants(launchers):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = [e[5:] for e in env if e.startswith(b"RANK=")]
        if rank and b"TORCHELASTIC_RUN_ID=" in b"\0".join(env):
            found[int(rank[0])] = pid
    return found


def _wait_for_ranks(procs: list[subprocess.Popen], world: int, timeout_s: float) -> dict[int, int]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        pids = find_rank_pids([p.pid for p in procs])
        if len(pids) == world or any(p.poll() is not None for p in procs):
            return pids
        time.sleep(0.05)
    return find_rank_pids([p.pid for p in procs])


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the launchers and every descendant."""
    for pid in [*_descendants([p.pid for p in procs]), *(p.pid for p in procs)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def _job_env(plan: LabPlan) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV}
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "LOGLEVEL": "ERROR",
        "MEGATRONAPP_RUN_ID": plan.tag,
        **fault_env(plan),
        **plan.env,
    }


def _launch(plan: LabPlan, trace_dir: Path, lab_net: net.LabNetwork | None, log) -> list[subprocess.Popen]:
    env = _job_env(plan)
    if lab_net is None:
        return [subprocess.Popen(local_command(plan, str(trace_dir)), env=env, stdout=log, stderr=subprocess.STDOUT)]
    procs = []
    for node in range(plan.nodes):
        node_dir = trace_dir / f"node{node}"
        node_dir.mkdir(parents=True, exist_ok=True)
        trace_env = AutoTraceConfig(trace_dir=str(node_dir)).to_env() if isinstance(plan.job, ScriptJob) else {}
        cmd = ["ip", "netns", "exec", lab_net.ns(node), *node_command(plan, node, str(node_dir))]
        procs.append(
            subprocess.Popen(cmd, env={**env, **node_env(), **trace_env}, stdout=log, stderr=subprocess.STDOUT)
        )
    return procs


def _rank_faults(plan: LabPlan, pids: dict[int, int], stack: contextlib.ExitStack) -> list[str]:
    applied, cores = [], cpu.lab_cores()
    for i, f in enumerate(x for x in plan.faults if isinstance(x, SlowRank)):
        targets = [pids[f.rank]]
        if f.method == "quota":
            share = f.quota_share(plan.job.nproc, len(cores))
            stack.enter_context(cpu.CpuQuota(f"{plan.tag}-{i}", targets, share, f.schedule))
            what = f"cgroup CPU quota {share:.0%} of a core ({f.factor}x below a fair share)"
        else:
            core = cores[f.rank % len(cores)]
            loops = max(1, round(f.factor - 1))  # the rank gets ~1 / factor of its core
            stack.enter_context(cpu.CompetingLoad(f"{plan.tag}-{i}", targets, core, f.schedule, loops))
            what = f"{loops} busy loop(s) sharing core {core}"
        when = f", {f.schedule.on_ms} ms of every {f.schedule.period_ms} ms" if f.schedule else ""
        when += f" from {f.schedule.start_ms} ms on" if f.schedule and f.schedule.start_ms else ""
        applied.append(f"rank {f.rank} (pid {pids[f.rank]}): {what}{when}")
    return applied


def _link_faults(plan: LabPlan, lab_net: net.LabNetwork | None, pids: dict[int, int]) -> list[str]:
    links = [f for f in plan.faults if isinstance(f, SlowLink)]
    if not links:
        return []
    node_of = {r: _node_of(lab_net, pid) for r, pid in pids.items()}  # rendezvous order decides ranks
    support = net.probe_qdiscs()
    return [
        f"link {f.src}->{f.dst}: " + lab_net.limit_link(node_of[f.src], node_of[f.dst], f.rate_mbit, support)
        for f in links
    ]


def _node_of(lab_net: net.LabNetwork, pid: int) -> int:
    name = subprocess.run(
        ["ip", "netns", "identify", str(pid)], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    return next(i for i in range(lab_net.nodes) if lab_net.ns(i) == name)


def gather_node_traces(trace_dir: Path, nodes: int) -> None:
    """Copy every node's rank files, and the link probe's result (rank 0's node), into trace_dir,
    as one would after a multi-machine run."""
    for node in range(nodes):
        for f in sorted((trace_dir / f"node{node}").glob("rank*.mscan")):
            shutil.copy2(f, trace_dir / f.name)
        probe = trace_dir / f"node{node}" / PROBE_FILE
        if probe.is_file():
            shutil.copy2(probe, trace_dir / PROBE_FILE)


def run_lab(plan: LabPlan, trace_dir: Path, timeout_s: float = 120.0) -> LabResult:
    """Run `plan` (module docstring); rank files end up in trace_dir. Faults are always undone."""
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    log_path = trace_dir.parent / f"{trace_dir.name}.log"
    t0, applied, code = time.monotonic(), [], -1
    with contextlib.ExitStack() as stack, open(log_path, "w") as log:
        noise = [f for f in plan.faults if isinstance(f, Noise)]
        if noise:
            stack.enter_context(cpu.BackgroundNoise(noise[0].per_core))
            applied.append(f"background noise: {noise[0].per_core} busy loop(s) per core")
        lab_net = stack.enter_context(net.LabNetwork(plan.tag, plan.nodes)) if plan.nodes else None
        procs = _launch(plan, trace_dir, lab_net, log)
        stack.callback(kill_all, procs)
        pids = _wait_for_ranks(procs, plan.job.nproc, timeout_s / 2)
        if len(pids) == plan.job.nproc:
            applied += _rank_faults(plan, pids, stack) + _link_faults(plan, lab_net, pids)
        code = _wait(procs, t0 + timeout_s)
    if plan.nodes:
        gather_node_traces(trace_dir, plan.nodes)
    return LabResult(code, trace_dir, time.monotonic() - t0, tuple(applied), log_path)


def _wait(procs: list[subprocess.Popen], deadline: float) -> int:
    """Highest exit code of the launchers, or -1 if the deadline passed first."""
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            return -1
    return max(codes, default=0)
