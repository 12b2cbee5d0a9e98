"""Process groups for a layout, built in one place and passed explicitly.

`build_process_groups` must run on every rank in the same order (torch.distributed.new_group
is collective over the world). When a group has a single member we store None: every
communication helper treats None as "nothing to communicate", so one code path serves one
process and many.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatronapp.parallel.layout import ParallelLayout, RankCoords, RoleCoords, RoleLayout


@dataclass(frozen=True)
class ParallelGroups:
    layout: ParallelLayout
    rank: int
    coords: RankCoords
    tp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    model_parallel: dist.ProcessGroup | None  # tp x pp of one replica: grad-norm reduction
    pp_ranks: tuple[int, ...]  # global rank of each pipeline stage of my pipeline
    # every rank of this layout (metrics, checkpoint barriers): the default group in a plain
    # job, the backward workers' subgroup under forward-backward disaggregation; None alone
    world: dist.ProcessGroup | None = None

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.layout.pp_size - 1


def single_process_groups(layout: ParallelLayout | None = None) -> ParallelGroups:
    """Groups for a run without torch.distributed (world size 1)."""
    layout = layout or ParallelLayout(world_size=1)
    return ParallelGroups(layout, 0, layout.coords(0), None, None, None, None, (0,))


def destroy_subgroups(groups: ParallelGroups | None) -> None:
    """Destroy the TP/DP/PP/model-parallel groups this rank belongs to (not the default group)."""
    if groups is None or not dist.is_initialized():
        return
    for group in {g for g in (groups.tp, groups.dp, groups.pp, groups.model_parallel) if g is not None}:
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def _new_groups(all_ranks: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = group
    return mine


def build_process_groups(layout: ParallelLayout, rank: int) -> ParallelGroups:
    """Create TP, DP, PP and model-parallel groups; collective over the default group."""
    if layout.world_size == 1:
        return single_process_groups(layout)
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout expects world size {layout.world_size}, "
                         f"torch.distributed has {dist.get_world_size()}")
    coords = layout.coords(rank)
    tp = _new_groups(layout.tp_group_ranks(), rank)
    dp = _new_groups(layout.dp_group_ranks(), rank)
    pp = _new_groups(layout.pp_group_ranks(), rank)
    mp = _new_groups(layout.model_parallel_group_ranks(), rank)
    pp_ranks = tuple(layout.rank_of(coords.tp, coords.dp, p) for p in range(layout.pp_size))
    return ParallelGroups(layout, rank, coords, tp, dp, pp, mp, pp_ranks, dist.group.WORLD)


@dataclass(frozen=True)
class RoleGroups:
    """Groups of one rank of a forward/backward-disaggregated job (layout: RoleLayout).

    `parallel` is what the engine sees. Backward workers: their TP/DP/PP/model-parallel
    groups, with `world` the subgroup of all backward ranks (their global ranks equal their
    layout ranks). Forward workers: only `tp` (their TF group) is set, `rank` is the index
    among forward workers and `pp_ranks` the global ranks of their forward pipeline.
    """

    layout: RoleLayout
    rank: int  # global rank in the job
    coords: RoleCoords
    parallel: ParallelGroups

    @property
    def is_forward(self) -> bool:
        return self.coords.is_forward


def build_role_groups(layout: RoleLayout, rank: int) -> RoleGroups:
    """Create both roles' groups; collective over the default group, same order on every rank."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"role layout expects world size {layout.world_size}, "
                         f"torch.distributed has {dist.get_world_size()}")
    bwd, coords = layout.backward, layout.role_of(rank)
    groups = [_new_groups(ranks, rank) for ranks in (bwd.tp_group_ranks(), bwd.dp_group_ranks(),
                                                     bwd.pp_group_ranks(), bwd.model_parallel_group_ranks())]
    world = _new_groups([list(range(layout.num_backward))], rank)
    ftp = _new_groups(layout.forward_tp_group_ranks(), rank)
    if coords.is_forward:
        fwd = layout.forward
        local = rank - layout.num_backward
        pp_ranks = tuple(layout.forward_rank(coords.tp, coords.dp, p) for p in range(layout.pp_size))
        parallel = ParallelGroups(fwd, local, fwd.coords(local), ftp, None, None, None, pp_ranks, None)
    else:
        pp_ranks = tuple(bwd.rank_of(coords.tp, coords.dp, p) for p in range(layout.pp_size))
        parallel = ParallelGroups(bwd, rank, bwd.coords(rank), *groups, pp_ranks, world)
    return RoleGroups(layout, rank, coords, parallel)
