"""Pure rank arithmetic for a TP x DP x PP layout (Megatron's rank order).

Global ranks are laid out with tensor parallelism fastest, then data, then pipeline:

    global_rank = tp_rank + dp_rank * TP + pp_rank * TP * DP

Worked example, world 8 with TP=2, PP=2 (so DP=2):

    rank: 0 1 2 3 4 5 6 7
    tp:   0 1 0 1 0 1 0 1
    dp:   0 0 1 1 0 0 1 1
    pp:   0 0 0 0 1 1 1 1

    TP groups: [0,1] [2,3] [4,5] [6,7]     (same dp, pp)
    DP groups: [0,2] [1,3] [4,6] [5,7]     (same tp, pp)
    PP groups: [0,4] [1,5] [2,6] [3,7]     (same tp, dp)

Nothing here touches torch.distributed: these functions are tested in one process for
world sizes far beyond what a test machine can spawn.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message says why in one line."""


@dataclass(frozen=True)
class RankCoords:
    tp: int
    dp: int
    pp: int

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp}


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism. `dp_size` is inferred from the world size."""

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    virtual_pp_size: int = 1  # model chunks per pipeline rank (interleaving when > 1)
    # layers of each virtual stage, in virtual-stage order (parallel/partition.py); () splits them evenly
    stage_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "virtual_pp_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size % (self.tp_size * self.pp_size) != 0:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by "
                f"tensor-parallel size {self.tp_size} x pipeline-parallel size {self.pp_size}"
            )
        if self.virtual_pp_size > 1 and self.pp_size < 2:
            raise LayoutError("virtual pipeline stages need pipeline-parallel size >= 2")
        if self.stage_layers and len(self.stage_layers) != self.pp_size * self.virtual_pp_size:
            raise LayoutError(
                f"{len(self.stage_layers)} stage layer counts for {self.pp_size * self.virtual_pp_size} virtual stages"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        tp = rank % self.tp_size
        dp = (rank // self.tp_size) % self.dp_size
        pp = rank // (self.tp_size * self.dp_size)
        return RankCoords(tp=tp, dp=dp, pp=pp)

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return tp + dp * self.tp_size + pp * self.tp_size * self.dp_size

    def tp_group_ranks(self) -> list[list[int]]:
        return [
            [self.rank_of(t, d, p) for t in range(self.tp_size)]
            for p in range(self.pp_size)
            for d in range(self.dp_size)
        ]

    def dp_group_ranks(self) -> list[list[int]]:
        return [
            [self.rank_of(t, d, p) for d in range(self.dp_size)]
            for p in range(self.pp_size)
            for t in range(self.tp_size)
        ]

    def pp_group_ranks(self) -> list[list[int]]:
        return [
            [self.rank_of(t, d, p) for p in range(self.pp_size)]
            for d in range(self.dp_size)
            for t in range(self.tp_size)
        ]

    def embedding_group_ranks(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline (one rank when PP is 1): where the
        input embedding and a tied output layer live. Example: TP 1, DP 2, PP 3 -> [[0, 4], [1, 5]]."""
        last = self.pp_size - 1
        return [
            sorted({self.rank_of(t, d, 0), self.rank_of(t, d, last)})
            for d in range(self.dp_size)
            for t in range(self.tp_size)
        ]

    def model_parallel_group_ranks(self) -> list[list[int]]:
        """Ranks holding one full model replica (all tp x pp for a fixed dp)."""
        return [
            sorted(self.rank_of(t, d, p) for p in range(self.pp_size) for t in range(self.tp_size))
            for d in range(self.dp_size)
        ]

    def describe(self) -> str:
        layers = f" layers={','.join(map(str, self.stage_layers))}" if self.stage_layers else ""
        return (
            f"world={self.world_size} TP={self.tp_size} PP={self.pp_size} VPP={self.virtual_pp_size} DP={self.dp_size}"
            + layers
        )
