"""Where each rank computes, and which transport each group and link may use (pure).

NCCL forbids two ranks of one communicator on the same GPU ("invalid usage"), and cannot
move CPU tensors at all; gloo moves CPU tensors between any ranks. So the transport of a
group or a point-to-point link follows from where its members compute:

* all members on distinct GPUs  -> NCCL, tensors stay on the device;
* otherwise (a member on CPU, or two members on one GPU) -> gloo, tensors staged in host memory.

Jobs whose ranks compute on GPUs initialise the default group as "cpu:gloo,cuda:nccl", so the
device of a tensor picks the backend of each message; `compute_link_device_kind` chooses that
device per link. The engine's own groups (TP, DP, PP, model-parallel, world) move tensors on
the compute device, so on GPUs they must be NCCL-valid: `check_gpu_groups` refuses, in one
line and before anything is spawned, a layout that would put two of their members on one GPU.

Placement rule (torchrun's local ranks, `ranks_per_node` consecutive global ranks per node):
rank r runs on GPU (r mod ranks_per_node) mod gpus_per_node of node r // ranks_per_node; the
wrap-around is what an oversubscribed launch would do, and the group check refuses it. Under
forward-backward disaggregation a forward worker on CUDA shares its backward twin's GPU
(spare memory on the expensive device; fbd.layout.RoleLayout.twin_of, whose placement
functions build on these).

Worked example, one GPU, RoleLayout(world 2, TP 1, PP 1, TF 1), forward on cuda:
    rank 0 backward -> GPU 0, rank 1 forward -> GPU 0 (twin 0); link 0 <-> 1: gloo (same GPU);
    no engine group has two members, so the layout is accepted. Plain PP2 on that GPU: the
    pipeline group [0, 1] would hold ranks 0 and 1 on GPU 0 -> refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatronapp.parallel.layout import LayoutError, ParallelLayout

DEVICE_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    """Where one rank computes: the CPU, or GPU `index` of node `node`."""

    kind: str  # "cpu" | "cuda"
    index: int = 0  # CUDA device index on its node (0 on CPU)
    node: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def describe(self) -> str:
        if not self.is_cuda:
            return "the CPU"
        return f"GPU {self.index}" + (f" of node {self.node}" if self.node else "")


def resolve_device_kind(requested: str | None, visible_gpus: int, flag: str = "--device") -> str:
    """'cpu' or 'cuda' for a device flag (None: cuda when a GPU is visible); one-line error otherwise."""
    if requested is None:
        return "cuda" if visible_gpus else "cpu"
    if requested not in DEVICE_KINDS:
        raise LayoutError(f"{flag} must be one of {', '.join(DEVICE_KINDS)}, got {requested!r}")
    if requested == "cuda" and visible_gpus < 1:
        raise LayoutError(f"{flag} cuda requested but no GPU is visible")
    return requested


def local_gpu_index(local_rank: int, gpus_per_node: int) -> int:
    """The placement rule: local rank r computes on GPU r mod (GPUs of its node)."""
    if gpus_per_node < 1:
        raise LayoutError("CUDA requested but no GPU is visible")
    return local_rank % gpus_per_node


def _gpu_of(rank: int, gpus_per_node: int, ranks_per_node: int) -> Placement:
    return Placement("cuda", local_gpu_index(rank % ranks_per_node, gpus_per_node), rank // ranks_per_node)


def compute_plain_placements(
    world_size: int, kind: str, gpus_per_node: int = 0, ranks_per_node: int | None = None
) -> tuple[Placement, ...]:
    """Placement of every rank of a plain job whose ranks all compute on `kind`."""
    if kind not in DEVICE_KINDS:
        raise LayoutError(f"device must be one of {', '.join(DEVICE_KINDS)}, got {kind!r}")
    per_node = ranks_per_node or world_size
    return tuple(Placement("cpu") if kind == "cpu" else _gpu_of(r, gpus_per_node, per_node) for r in range(world_size))


def compute_group_backend(members: Sequence[Placement]) -> str:
    """'nccl' when every member computes on its own GPU, else 'gloo' (host-staged tensors)."""
    gpus = [(p.node, p.index) for p in members if p.is_cuda]
    return "nccl" if len(gpus) == len(members) and len(set(gpus)) == len(gpus) else "gloo"


def compute_link_device_kind(a: Placement, b: Placement) -> str:
    """Device of the tensors of a point-to-point link between ranks placed at a and b:
    'cuda' (NCCL) only when both compute on distinct GPUs, else 'cpu' (gloo)."""
    return "cuda" if compute_group_backend((a, b)) == "nccl" else "cpu"


def compute_default_backend(placements: Sequence[Placement]) -> str:
    """Backend of the default group: gloo for CPU-only jobs, else both, chosen per tensor device."""
    return "cpu:gloo,cuda:nccl" if any(p.is_cuda for p in placements) else "gloo"


def engine_group_ranks(layout: ParallelLayout, offset: int = 0) -> list[tuple[str, list[int]]]:
    """(name, global ranks) of every group the engine moves device tensors through."""
    named = [
        ("tensor-parallel", layout.tp_group_ranks()),
        ("data-parallel", layout.dp_group_ranks()),
        ("pipeline-parallel", layout.pp_group_ranks()),
        ("model-parallel", layout.model_parallel_group_ranks()),
        ("world", [list(range(layout.world_size))]),
    ]
    return [(name, [offset + r for r in ranks]) for name, groups in named for ranks in groups if len(ranks) > 1]


def check_gpu_groups(
    groups: Sequence[tuple[str, Sequence[int]]], placements: Sequence[Placement], visible_gpus: int | None = None
) -> None:
    """Refuse (LayoutError, one line) a group of GPU ranks that shares a GPU: NCCL cannot run it."""
    for name, ranks in groups:
        members = [placements[r] for r in ranks]
        if not all(p.is_cuda for p in members) or compute_group_backend(members) == "nccl":
            continue
        seen: dict[Placement, int] = {}
        for r in ranks:
            if placements[r] in seen:
                visible = f" ({visible_gpus} visible)" if visible_gpus is not None else ""
                flag = "--forward-device" if name.startswith("forward") else "--device"
                raise LayoutError(
                    f"{name} group {list(ranks)} would put ranks {seen[placements[r]]} and {r} on "
                    f"{placements[r].describe()}{visible}: NCCL needs one GPU per rank of a group; "
                    f"use fewer ranks, more GPUs, or {flag} cpu"
                )
            seen[placements[r]] = r
