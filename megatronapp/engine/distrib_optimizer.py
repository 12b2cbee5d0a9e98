"""Shard arithmetic of the distributed optimizer (ZeRO-1, as Megatron-Core's).

Every gradient bucket (see engine.grads) is padded to a multiple of the DP size and cut
into DP-size equal contiguous shards; DP rank r owns shard r of every bucket. It keeps
fp32 master weights and Adam state only for the parts of parameters inside its shards.
After the reduce-scatter its shard of the main-grad buffer holds the DP-summed gradient
of exactly those parts; after the step the updated parameter shards are all-gathered.

Example: one bucket [0, 12) with params a = [0, 5), b = [5, 10), padding [10, 12), DP 2:
rank 0 owns [0, 6) -> a[0:5], b[0:1]; rank 1 owns [6, 12) -> b[1:5].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronapp.engine.grads import BucketSpan, ChunkGradBuffer, all_gather_flat


@dataclass(frozen=True)
class ShardRange:
    param: int  # index of the parameter in its chunk (forward order)
    start: int  # [start, end) of the flattened parameter owned by this DP rank
    end: int


def compute_shard_ranges(
    offsets: list[int], numels: list[int], buckets: list[BucketSpan], dp_size: int, dp_rank: int
) -> list[ShardRange]:
    """The non-empty parameter slices inside `dp_rank`'s shard of every bucket."""
    ranges = []
    for b in buckets:
        size = (b.end - b.start) // dp_size
        lo, hi = b.start + dp_rank * size, b.start + (dp_rank + 1) * size
        for i in b.params:
            start, end = max(lo, offsets[i]), min(hi, offsets[i] + numels[i])
            if start < end:
                ranges.append(ShardRange(i, start - offsets[i], end - offsets[i]))
    return ranges


def gather_full_params(
    buf: ChunkGradBuffer, shards: dict[int, tuple[ShardRange, torch.Tensor]], dp_group, dp_size: int, dp_rank: int
) -> list[torch.Tensor | None]:
    """Collective over DP: full fp32 tensors (shaped like the chunk's params) from the
    shard pieces every rank holds (`shards`: param index -> (range, flat piece))."""
    full_params: list[torch.Tensor | None] = [None] * len(buf.params)
    device = buf.grad_data.device
    for b in buf.buckets:
        n = b.span.end - b.span.start
        lo = b.span.start + dp_rank * (n // dp_size)
        local = torch.zeros(n // dp_size, dtype=torch.float32, device=device)
        for i in b.span.params:
            if i in shards:
                r, piece = shards[i]
                at = buf.offsets[i] + r.start - lo
                local[at : at + r.end - r.start] = piece
        full = torch.empty(n, dtype=torch.float32, device=device)
        if dp_group is None:
            full.copy_(local)
        else:
            all_gather_flat(full, local, group=dp_group)
        for i in b.span.params:
            p, at = buf.params[i], buf.offsets[i] - b.span.start
            full_params[i] = full[at : at + p.numel()].view_as(p)
    return full_params
