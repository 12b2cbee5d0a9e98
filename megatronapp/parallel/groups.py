"""Process groups for a layout, built in one place and passed explicitly.

`build_process_groups` must run on every rank in the same order (torch.distributed.new_group
is collective over the world). When a group has a single member we store None: every
communication helper treats None as "nothing to communicate", so one code path serves one
process and many.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatronapp.parallel.layout import ParallelLayout, RankCoords


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
    # first and last pipeline stage of my pipeline: a tied embedding's gradients are summed over it
    embedding: dist.ProcessGroup | None = None

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
    for group in {g for g in (groups.tp, groups.dp, groups.pp, groups.model_parallel, groups.embedding) if g}:
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def new_member_group(all_ranks: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """Create every group of `all_ranks` (collective: every rank calls it with the same list) and
    return the one `rank` belongs to; None for a single-member group or when it is in none."""
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
        raise ValueError(
            f"layout expects world size {layout.world_size}, torch.distributed has {dist.get_world_size()}"
        )
    coords = layout.coords(rank)
    tp = new_member_group(layout.tp_group_ranks(), rank)
    dp = new_member_group(layout.dp_group_ranks(), rank)
    pp = new_member_group(layout.pp_group_ranks(), rank)
    mp = new_member_group(layout.model_parallel_group_ranks(), rank)
    embedding = new_member_group(layout.embedding_group_ranks(), rank)
    pp_ranks = tuple(layout.rank_of(coords.tp, coords.dp, p) for p in range(layout.pp_size))
    return ParallelGroups(layout, rank, coords, tp, dp, pp, mp, pp_ranks, dist.group.WORLD, embedding)
