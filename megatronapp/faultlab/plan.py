"""What a lab run is: the traced job, the faults put on the machine, and where ranks live.

Pure data and command lines; faultlab/runner.py executes them. A job is either an engine job
(`megatronapp train --trace`) or an unmodified script under `megatronapp trace run` (or, one
namespace per node, torchrun with the zero-code tracer `megatronapp.scan.record.run`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from megatronapp.faultlab.cpu import Schedule
from megatronapp.faultlab.net import IFNAME, address
from megatronapp.launch.local import torchrun_command, trace_run_command

RDZV_PORT = 29431


@dataclass(frozen=True)
class ScriptJob:
    """An unmodified training script (e.g. examples/ddp_train.py) on `nproc` ranks."""

    script: str
    args: tuple[str, ...] = ()
    nproc: int = 2

    def module_args(self) -> list[str]:
        return ["megatronapp.scan.record.run", self.script, *self.args]


@dataclass(frozen=True)
class EngineJob:
    """A tiny engine job: TP x PP x DP ranks of `megatronapp train --trace` on CPU."""

    tp: int = 1
    pp: int = 2
    dp: int = 2
    iters: int = 16
    extra: tuple[str, ...] = ("--model", "tiny", "--global-batch-size", "8", "--micro-batch-size", "2")
    seed: int = 1

    @property
    def nproc(self) -> int:
        return self.tp * self.pp * self.dp

    def module_args(self, trace_dir: str) -> list[str]:
        return [
            "megatronapp.cli.main",
            "train",
            "--tensor-model-parallel-size",
            str(self.tp),
            "--pipeline-model-parallel-size",
            str(self.pp),
            "--train-iters",
            str(self.iters),
            "--log-interval",
            str(self.iters),
            "--device",
            "cpu",
            "--seed",
            str(self.seed),
            *self.extra,
            "--trace",
            "--trace-dir",
            trace_dir,
        ]


@dataclass(frozen=True)
class SlowRank:
    """Less CPU for one rank: a cgroup quota of 1/factor of its fair share of the cores
    ("quota"; 4 ranks on 2 cores get half a core each, so a quota above that slows nothing) or
    round(factor - 1) busy loops on its pinned core ("compete": it gets ~1 / factor of that core);
    on a schedule for an intermittent fault. A rank that also waits gets slower by less."""

    rank: int
    method: str = "quota"
    factor: float = 2.0
    schedule: Schedule | None = None

    def __post_init__(self) -> None:
        if self.method not in ("quota", "compete"):
            raise ValueError(f"slow rank method is 'quota' or 'compete', got {self.method!r}")
        if self.factor <= 1.0:
            raise ValueError(f"a slow rank's factor must be > 1 (times slower), got {self.factor}")

    def quota_share(self, nproc: int, cores: int) -> float:
        """Share of one core for the quota: the fair share min(1, cores / nproc) over factor."""
        return max(0.01, min(1.0, cores / nproc) / self.factor)


@dataclass(frozen=True)
class ExtraWork:
    """A straggler in user code: the script's rank does `matmuls` extra matmuls per step (the
    example scripts read STRAGGLER_RANK / STRAGGLER_WORK)."""

    rank: int
    matmuls: int


@dataclass(frozen=True)
class SlowLink:
    """src -> dst limited to rate_mbit (ranks in namespaces; see net.py)."""

    src: int
    dst: int
    rate_mbit: float


@dataclass(frozen=True)
class Noise:
    """A busy loop per core for the whole run: every rank slowed alike, nobody to blame."""

    per_core: int = 1


@dataclass(frozen=True)
class LabPlan:
    """One lab run. nodes 0: all ranks in this namespace under one launcher; nodes N: N network
    namespaces, each one torchrun node (c10d rendezvous) with nproc / N ranks."""

    job: ScriptJob | EngineJob
    faults: tuple = ()
    nodes: int = 0
    tag: str = "lab"
    env: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.job.nproc
        if any(isinstance(f, SlowLink) for f in self.faults) and self.nodes != n:
            raise ValueError(f"a slow link needs one namespace per rank: nodes={n}, got {self.nodes}")
        if self.nodes and n % self.nodes:
            raise ValueError(f"{n} ranks do not split over {self.nodes} nodes")
        for f in self.faults:
            for r in [getattr(f, a) for a in ("rank", "src", "dst") if hasattr(f, a)]:
                if not 0 <= r < n:
                    raise ValueError(f"{type(f).__name__} names rank {r}, but the job has ranks 0..{n - 1}")


def fault_env(plan: LabPlan) -> dict[str, str]:
    """Environment the job's ranks get from the faults (only the user-code straggler has any)."""
    env = {}
    for f in plan.faults:
        if isinstance(f, ExtraWork):
            env.update(STRAGGLER_RANK=str(f.rank), STRAGGLER_WORK=str(f.matmuls))
    return env


def local_command(plan: LabPlan, trace_dir: str) -> list[str]:
    """All ranks under one launcher: `megatronapp trace run` for a script, torchrun for the engine."""
    job = plan.job
    if isinstance(job, ScriptJob):
        return trace_run_command(job.nproc, trace_dir, [job.script, *job.args])
    return torchrun_command(job.module_args(trace_dir), job.nproc)


def node_command(plan: LabPlan, node: int, trace_dir: str) -> list[str]:
    """Node `node`'s torchrun, inside its namespace (net.py): rendezvous at node 0's address."""
    job, per_node = plan.job, plan.job.nproc // plan.nodes
    module = job.module_args() if isinstance(job, ScriptJob) else job.module_args(trace_dir)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(plan.nodes),
        "--nproc-per-node",
        str(per_node),
        "--node-rank",
        str(node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{address(0)}:{RDZV_PORT}",
        "--rdzv-id",
        plan.tag,
        "--local-addr",
        address(node),
        # node 0 serves the rendezvous store: torch decides that by hostname, which all namespaces share
        "--rdzv-conf",
        f"is_host={int(node == 0)},join_timeout=60",
        "--monitor-interval",
        "0.1",
        "--module",
        *module,
    ]


def node_env() -> dict[str, str]:
    """Gloo binds the namespace's interface (the only one with an address besides loopback)."""
    return {"GLOO_SOCKET_IFNAME": IFNAME}
