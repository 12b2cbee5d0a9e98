"""Main params: the tensor AdamW updates for each model parameter (or, with the distributed
optimizer, each DP shard of one), how it is stored, and its fp32 main grad.

fp32 models are their own main params. bf16/fp16 models get fp32 copies (Megatron's master
weights); with the precision-aware optimizer (engine/precision_adam.py) copies of
--main-params-dtype, or, with remainders, the bf16 model weights themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatronapp.config import OptimizerConfig, PrecisionConfig
from megatronapp.engine.distrib_optimizer import ShardRange, compute_shard_ranges
from megatronapp.engine.grads import GradReducer
from megatronapp.engine.precision_adam import STATE_DTYPES, StatePrecision


def compute_state_precision(cfg: OptimizerConfig, precision: PrecisionConfig) -> StatePrecision | None:
    """How the precision-aware optimizer stores its state, or None for the plain optimizer.
    Remainders apply where the master is fp32 and the model weight bf16 (as Megatron-Core)."""
    if not cfg.use_precision_aware_optimizer:
        return None
    return StatePrecision(
        main_params=STATE_DTYPES[cfg.main_params_dtype],
        exp_avg=STATE_DTYPES[cfg.exp_avg_dtype],
        exp_avg_sq=STATE_DTYPES[cfg.exp_avg_sq_dtype],
        param_remainders=cfg.store_param_remainders and precision.bf16 and cfg.main_params_dtype == "fp32",
    )


@dataclass
class MainParam:
    """The tensor AdamW updates for (a slice of) one model parameter, and its fp32 main grad."""

    model_param: nn.Parameter
    # the model param itself (fp32, not sharded) or an fp32 copy; precision-aware: a copy of
    # --main-params-dtype, or the bf16 model view itself when masters are stored as remainders
    main_param: torch.Tensor
    shard: ShardRange | None  # slice of the flattened model param; None: the whole param
    count_in_norm: bool  # False for TP-replicated params off TP rank 0
    # the main grad of the same elements: fp32 (bf16 with --main-grads-dtype bf16); also
    # `main_param.grad` where the dtypes match
    main_grad: torch.Tensor


def build_main_params(reducer: GradReducer, tp_rank: int, store: StatePrecision | None) -> list[list[MainParam]]:
    """Per chunk: one MainParam per parameter, or per owned shard with the distributed optimizer.
    `store`: the precision-aware optimizer's storage (None: fp32 masters)."""
    out = []
    for buf in reducer.buffers:
        mains = []
        if reducer.distributed:
            spans = [b.span for b in buf.buckets]
            for r in compute_shard_ranges(
                buf.offsets, [p.numel() for p in buf.params], spans, reducer.dp_size, reducer.dp_rank
            ):
                p = buf.params[r.param]
                view = p.detach().view(-1)[r.start : r.end]  # fp32: the param buffer itself
                grad = p.main_grad.view(-1)[r.start : r.end]
                mains.append(MainParam(p, _main_of(view, grad, store), r, _counts(p, tp_rank), grad))
        else:
            for p in buf.params:
                main = p if p.dtype == torch.float32 else _main_of(p.detach(), p.main_grad, store)
                mains.append(MainParam(p, main, None, _counts(p, tp_rank), p.main_grad))
        out.append(mains)
    return out


def _main_of(view: torch.Tensor, grad: torch.Tensor, store: StatePrecision | None) -> torch.Tensor:
    """The main param of a model tensor `view`: itself where it is fp32 or stores its master's
    high half, else a copy (fp32, or the precision-aware --main-params-dtype); an fp32 main
    also carries an fp32 `grad` as its `.grad` (torch's AdamW and the master kernel read it there)."""
    if view.dtype == torch.float32 or (store is not None and store.param_remainders):
        main = view
    else:
        main = view.to(torch.float32 if store is None else store.main_params)
    if main.dtype == grad.dtype:
        main.grad = grad
    return main


def _counts(p: nn.Parameter, tp_rank: int) -> bool:
    """Whether p's gradient counts in the norm on this rank: TP-replicated ones on TP rank 0 only,
    a tied output layer never (its gradient is the embedding's, counted there)."""
    if getattr(p, "tied_embedding", None) == "output":
        return False
    return getattr(p, "tp_split_dim", None) is not None or tp_rank == 0
