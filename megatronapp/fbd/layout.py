"""Rank arithmetic and placement of a job split into backward and forward workers (MegaFBD).

Pure, like parallel/layout.py and parallel/placement.py on which it builds: the backward
workers are an ordinary `ParallelLayout`, the forward workers a second one after them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.parallel.layout import LayoutError, ParallelLayout
from megatronapp.parallel.placement import DEVICE_KINDS, Placement, compute_plain_placements, engine_group_ranks


@dataclass(frozen=True)
class RoleCoords:
    """Where a rank sits in a forward/backward-disaggregated job."""

    role: str  # "backward" | "forward"
    tp: int  # TP rank within its role (forward workers: rank within TF)
    dp: int
    pp: int

    @property
    def is_forward(self) -> bool:
        return self.role == "forward"


@dataclass(frozen=True)
class RoleLayout:
    """Rank arithmetic of a job split into backward workers and forward workers (MegaFBD).

    Backward workers come first and are an ordinary TP x DP x PP layout of
    B = TP * PP * DP ranks (Megatron order, `ParallelLayout`), so an FBD checkpoint is the
    checkpoint of a plain job of world B. Forward workers follow, TF x DP x PP in the same
    order: forward rank = B + tf + dp * TF + pp * TF * DP. World = (TP + TF) * PP * DP.

    Worked example, world 6 with TP=2, PP=2, TF=1 (so DP=1):

        rank: 0 1 2 3 | 4 5
        role: b b b b | f f
        tp:   0 1 0 1 | 0 0
        pp:   0 0 1 1 | 0 1

        stage inputs (forward -> backward, same dp and pp):   5 -> 2, 3   (4 feeds nobody:
            stage 0's input is tokens, which backward workers read themselves)
        weights (backward -> forward twins, resharded TP -> TF):  0, 1 -> 4   2, 3 -> 5

    Backward TP rank t takes stage inputs from forward TP rank t % TF (activations between
    stages are replicated over TP, so any forward TP rank holds the whole tensor). Weights:
    backward t holds the slice [t/TP, (t+1)/TP) of every split tensor, forward f needs
    [f/TF, (f+1)/TF); they exchange the overlap. Replicated tensors come from the first
    backward TP rank overlapping f.
    """

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    forward_tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "forward_tp_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        per_dp = (self.tp_size + self.forward_tp_size) * self.pp_size
        if self.world_size % per_dp:
            raise LayoutError(
                f"forward-backward disaggregation needs world size = (TP {self.tp_size} + forward TP "
                f"{self.forward_tp_size}) x PP {self.pp_size} x DP, but world size {self.world_size} "
                f"is not a multiple of {per_dp}"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // ((self.tp_size + self.forward_tp_size) * self.pp_size)

    @property
    def backward(self) -> ParallelLayout:
        return ParallelLayout(self.tp_size * self.pp_size * self.dp_size, self.tp_size, self.pp_size)

    @property
    def forward(self) -> ParallelLayout:
        return ParallelLayout(self.forward_tp_size * self.pp_size * self.dp_size, self.forward_tp_size, self.pp_size)

    @property
    def num_backward(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    def role_of(self, rank: int) -> RoleCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        if rank < self.num_backward:
            c = self.backward.coords(rank)
            return RoleCoords("backward", c.tp, c.dp, c.pp)
        c = self.forward.coords(rank - self.num_backward)
        return RoleCoords("forward", c.tp, c.dp, c.pp)

    def backward_rank(self, tp: int, dp: int, pp: int) -> int:
        return self.backward.rank_of(tp, dp, pp)

    def forward_rank(self, tp: int, dp: int, pp: int) -> int:
        return self.num_backward + self.forward.rank_of(tp, dp, pp)

    def twin_of(self, rank: int) -> int:
        """Backward worker whose device a forward worker shares when both roles are on GPUs
        (itself for a backward worker): forward (tf, dp, pp) -> backward (tf mod TP, dp, pp)."""
        c = self.role_of(rank)
        return self.backward_rank(c.tp % self.tp_size, c.dp, c.pp) if c.is_forward else rank

    def input_source(self, tp: int, dp: int, pp: int) -> int:
        """Forward rank that sends backward worker (tp, dp, pp) its stage inputs and losses."""
        return self.forward_rank(tp % self.forward_tp_size, dp, pp)

    def input_targets(self, ftp: int, dp: int, pp: int) -> list[int]:
        """Backward ranks that forward worker (ftp, dp, pp) sends stage inputs and losses to."""
        return [self.backward_rank(t, dp, pp) for t in range(self.tp_size) if t % self.forward_tp_size == ftp]

    def tp_overlap(self, tp: int, ftp: int) -> bool:
        """Do backward TP slice `tp` and forward TP slice `ftp` of a split tensor intersect?"""
        tp_size, ftp_size = self.tp_size, self.forward_tp_size  # compare in units of 1 / (TP * TF)
        return tp * ftp_size < (ftp + 1) * tp_size and ftp * tp_size < (tp + 1) * ftp_size

    def weight_sources(self, ftp: int, dp: int, pp: int) -> list[int]:
        """Backward ranks whose shards forward worker (ftp, dp, pp) receives, in TP order."""
        return [self.backward_rank(t, dp, pp) for t in range(self.tp_size) if self.tp_overlap(t, ftp)]

    def weight_targets(self, tp: int, dp: int, pp: int) -> list[int]:
        """Forward ranks that backward worker (tp, dp, pp) publishes weights to, in TF order."""
        return [self.forward_rank(f, dp, pp) for f in range(self.forward_tp_size) if self.tp_overlap(tp, f)]

    def forward_tp_group_ranks(self) -> list[list[int]]:
        return [[self.num_backward + r for r in ranks] for ranks in self.forward.tp_group_ranks()]

    def describe(self) -> str:
        return (
            f"world={self.world_size} backward TP={self.tp_size} PP={self.pp_size} DP={self.dp_size} "
            f"+ forward TF={self.forward_tp_size} ({self.world_size - self.num_backward} ranks)"
        )


def compute_role_placements(
    layout: RoleLayout, backward_kind: str, forward_kind: str, gpus_per_node: int = 0, ranks_per_node: int | None = None
) -> tuple[Placement, ...]:
    """Placement of every rank of an FBD job: backward ranks as a plain job; forward ranks on
    the CPU or on their backward twin's GPU (which must then be on the same node)."""
    per_node = ranks_per_node or layout.world_size
    backward = compute_plain_placements(layout.num_backward, backward_kind, gpus_per_node, per_node)
    if forward_kind not in DEVICE_KINDS:
        raise LayoutError(f"forward device must be one of {', '.join(DEVICE_KINDS)}, got {forward_kind!r}")
    placements = list(backward)
    for rank in range(layout.num_backward, layout.world_size):
        if forward_kind == "cpu":
            placements.append(Placement("cpu", node=rank // per_node))
            continue
        twin = backward[layout.twin_of(rank)]
        if not twin.is_cuda:
            raise LayoutError("--forward-device cuda shares the backward workers' GPUs: it needs --device cuda")
        if twin.node != rank // per_node:
            raise LayoutError(
                f"forward worker rank {rank} is on node {rank // per_node} but its backward twin "
                f"{layout.twin_of(rank)} on node {twin.node}: it cannot share that GPU"
            )
        placements.append(twin)
    return tuple(placements)


def role_group_ranks(layout: RoleLayout) -> list[tuple[str, list[int]]]:
    """Groups that carry device tensors in an FBD job: the backward workers' engine groups and
    the forward workers' TF groups. Every point-to-point message (hand-offs between the roles,
    activations between forward stages) is a link whose device is chosen per pair
    (compute_link_device_kind), so it needs no check."""
    forward = [("forward tensor-parallel", ranks) for ranks in layout.forward_tp_group_ranks() if len(ranks) > 1]
    return [("backward " + name, ranks) for name, ranks in engine_group_ranks(layout.backward)] + forward
