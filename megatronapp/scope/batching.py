"""A step's gathered captures turned into compressed items, in as few kernels as possible.

At batch 1 a decode step is bound by kernel launches, so the work per step must not grow
with the number of layers or sites. Per-layer tensors of the same kind (same dim names,
shape and dtype: e.g. attn_out, mlp_out and residual of every layer) are concatenated into
one *block* of rows, compressed by one chain of ops, and split back into items that are row
views of the block:

    block rows   site-major: [attn_out L0..Ln, mlp_out L0..Ln, residual L0..Ln]
    block.tensors[key]   (rows, *item shape): item i's tensors[key] is row i

so the default capture (3 sites x 24 layers, absmax to 64 buckets, fp16) is one cat, one
reduction and one cast, whatever the depth. Compression ops act per row on the item dims
(compress.py), so the rows never mix and the values equal per-item compression bit for bit.
The final top-k and logit-lens items are blocks of one row. Blocks are what staging.py packs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronapp.scope.compress import CapturedItem, apply_pipeline, select_indices
from megatronapp.scope.sites import HEAD_SITES, LAYER_SITES

DIMS = {
    "q": ("batch", "head", "token", "dim"),
    "k": ("batch", "head", "token", "dim"),
    "v": ("batch", "head", "token", "dim"),
    "attn_probs": ("batch", "head", "token", "key"),
    "attn_out": ("batch", "token", "hidden"),
    "fc1": ("batch", "token", "ffn"),
    "mlp_out": ("batch", "token", "hidden"),
    "residual": ("batch", "token", "hidden"),
    "logit_lens": ("layer", "batch", "k"),
    "topk": ("batch", "k"),
}


@dataclass
class Block:
    items: list[CapturedItem]  # one per row, in row order
    tensors: dict[str, torch.Tensor]  # key -> (rows, *item shape)


def compress_step(
    step: int, gathered, compress: tuple[dict, ...], heads, topk: int, lens_topk: int | None = None
) -> tuple[list, list[Block]]:
    """(items in `gathered` order, the blocks holding their tensors) of one step's gathered
    (name, layer, site, tensor) captures: per-layer sites compressed by `compress` (after
    keeping `heads` of head sites); topk data as given (its top `topk` already), logit_lens
    logits (L, B, V) reduced to their top `lens_topk` (None: `topk`) log-probabilities."""
    kept_layers = [set(op["layers"]) for op in compress if op["name"] == "slice" and "layers" in op]
    groups: dict[tuple, list] = {}
    built: dict[str, CapturedItem] = {}
    blocks = []
    for name, layer, site, data in gathered:
        if site in ("topk", "logit_lens"):
            block = final_block(step, site, data, topk if lens_topk is None else lens_topk)
            built[name] = block.items[0]
            blocks.append(block)
        elif all(layer in keep for keep in kept_layers):
            key = (DIMS[site], tuple(data.shape), data.dtype)
            groups.setdefault(key, []).append((name, layer, site, data))
    for entries in groups.values():
        entries.sort(key=lambda e: (LAYER_SITES.index(e[2]), e[1]))  # site-major rows
        block = compress_rows(step, entries, compress, heads)
        built.update(zip((e[0] for e in entries), block.items))
        blocks.append(block)
    return [built[name] for name, *_ in gathered if name in built], blocks


def final_block(step: int, site: str, data, topk: int) -> Block:
    """The one-item block of `topk` ((values, indices) already) or `logit_lens` (logits (L, B, V):
    top-k log-probabilities per layer)."""
    values, indices = data if site == "topk" else compute_top_probs(data, topk, log=True)
    tensors = {"data": values, "indices": indices.to(torch.int32)}
    item = CapturedItem(f"step{step}/{site}", site, step, None, DIMS[site], tensors)
    return Block([item], {k: t.unsqueeze(0) for k, t in tensors.items()})


def compute_top_probs(logits: torch.Tensor, k: int, log: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the top `k` of softmax(logits) (log_softmax with `log`) over the last
    dim, values in fp32, largest first; what `logits.float().softmax(-1).topk(k)` gives, cheaper
    on a GPU: the fp32 cast is fused into the softmax kernel, k = 1 is one max reduction, and a
    larger k ranks the logits in their own dtype (softmax is monotonic, so the same entries; a
    radix select over bf16 makes half the passes of one over fp32) and gathers their
    probabilities. Only which of several entries with exactly equal probability comes first
    may differ from ranking the probabilities."""
    probs = logits.log_softmax(-1, dtype=torch.float32) if log else logits.softmax(-1, dtype=torch.float32)
    if k == 1:
        top = probs.max(dim=-1, keepdim=True)
        return top.values, top.indices
    indices = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    return probs.gather(-1, indices), indices


def compress_rows(step: int, entries, compress: tuple[dict, ...], heads) -> Block:
    """One block of same-kind per-layer entries (name, layer, site, tensor): concatenated in
    one kernel (in the capture's dtype), compressed by the pipeline, fp32 unless quantized."""
    site = entries[0][2]
    # (rows, ...); one row (e.g. the UI's one shown layer) is a view, not a copy
    data = entries[0][3].unsqueeze(0) if len(entries) == 1 else torch.stack([d for *_, d in entries])
    if heads is not None and site in HEAD_SITES:
        data = select_indices(data, 2, heads)
    stacked = apply_pipeline(CapturedItem("", site, step, None, ("row", *DIMS[site]), {"data": data}), compress)
    ops = [{**op, "shape": op["shape"][1:]} for op in stacked.ops]
    items = [
        CapturedItem(
            f"step{step}/{name}",
            s,
            step,
            layer,
            stacked.dims[1:],
            {k: v[i] for k, v in stacked.tensors.items()},
            list(ops),
        )
        for i, (name, layer, s, _) in enumerate(entries)
    ]
    return Block(items, stacked.tensors)
