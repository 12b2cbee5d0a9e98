"""Process groups of one rank of a forward/backward-disaggregated job (layout: fbd.layout.RoleLayout).

Built like parallel/groups.py: collective over the default group, same order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatronapp.fbd.layout import RoleCoords, RoleLayout
from megatronapp.parallel.groups import ParallelGroups, new_member_group


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
        raise ValueError(
            f"role layout expects world size {layout.world_size}, torch.distributed has {dist.get_world_size()}"
        )
    bwd, coords = layout.backward, layout.role_of(rank)
    groups = [
        new_member_group(ranks, rank)
        for ranks in (
            bwd.tp_group_ranks(),
            bwd.dp_group_ranks(),
            bwd.pp_group_ranks(),
            bwd.model_parallel_group_ranks(),
        )
    ]
    embedding = new_member_group(bwd.embedding_group_ranks(), rank)
    world = new_member_group([list(range(layout.num_backward))], rank)
    ftp = new_member_group(layout.forward_tp_group_ranks(), rank)
    if coords.is_forward:
        fwd = layout.forward
        local = rank - layout.num_backward
        pp_ranks = tuple(layout.forward_rank(coords.tp, coords.dp, p) for p in range(layout.pp_size))
        parallel = ParallelGroups(fwd, local, fwd.coords(local), ftp, None, None, None, pp_ranks, None)
    else:
        pp_ranks = tuple(bwd.rank_of(coords.tp, coords.dp, p) for p in range(layout.pp_size))
        parallel = ParallelGroups(bwd, rank, bwd.coords(rank), *groups, pp_ranks, world, embedding)
    return RoleGroups(layout, rank, coords, parallel)
