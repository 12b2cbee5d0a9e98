"""What the attention and MLP modules are built from, shared by both: the TP context, the
chunk options, the norm a config names and the keyword arguments of the TP linears."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronapp.config import ModelConfig, RecomputeConfig
from megatronapp.parallel.layers import LayerNorm, RMSNorm
from megatronapp.parallel.random import RNGStatesTracker


@dataclass(frozen=True)
class TPContext:
    group: object | None
    size: int
    rank: int
    sequence_parallel: bool = False  # activations outside TP blocks are (B, S/TP, H) shards


@dataclass(frozen=True)
class ChunkOptions:
    """How the layers of a chunk run in training (not what they compute)."""

    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    rng_tracker: RNGStatesTracker | None = None  # attention-dropout stream (needed when it is > 0)


def build_norm(cfg: ModelConfig, tp: TPContext, device) -> LayerNorm | RMSNorm:
    """The normalization `cfg` names (LayerNorm or RMSNorm), replicated over TP."""
    norm = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return norm(
        cfg.hidden_size, cfg.layernorm_epsilon, tp_group=tp.group, sequence_parallel=tp.sequence_parallel, device=device
    )


def tp_linear_kwargs(tp: TPContext, seed: int, device) -> dict:
    return dict(
        tp_group=tp.group,
        tp_size=tp.size,
        tp_rank=tp.rank,
        seed=seed,
        device=device,
        sequence_parallel=tp.sequence_parallel,
    )
