"""Moving captures to the serving rank: TP all-gather, logit-lens residuals to the last
stage, and one packed transfer per pipeline stage to global rank 0.

Every rank calls `collect_step` in the same order at the end of a step. Item names are a
pure function of (stage layers, sites), so only shapes travel in the header:

    header  int64 [n, ndim_1, *shape_1, ..., ndim_n, *shape_n]
    data    fp32, the items flattened and concatenated in name order
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatronapp.inference.model import SERVING_RANK, gather_last_dim
from megatronapp.parallel.partition import compute_chunk_layer_ranges, compute_stage_layers
from megatronapp.scope.hooks import LENS
from megatronapp.scope.sites import HEAD_SITES, LAYER_SITES


def gather_tp(t: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    if group is None:
        return t
    moved = t.movedim(dim, -1)
    return gather_last_dim(moved, group, size).movedim(-1, dim)


def stage_items(target, layers, sites, stash) -> list[tuple[str, int, str, torch.Tensor]]:
    """(name, layer, site, full-TP tensor) of this rank's layers, gathered over TP (collective)."""
    out = []
    for layer in sorted(set(layers) & set(target.blocks())):
        for site in LAYER_SITES:
            if site not in sites:
                continue
            t = stash[(layer, site)]
            if site in HEAD_SITES:
                t = gather_tp(t, 1, target.tp_group, target.tp_size)
            elif site == "fc1":
                t = gather_tp(t, t.dim() - 1, target.tp_group, target.tp_size)
            out.append((f"layer{layer}/{site}", layer, site, t))
    return out


def compute_logit_lens(model, stash) -> torch.Tensor | None:
    """Logits (L, B, V) over the real vocabulary of each layer's newest-column residual, in the
    model's dtype, on the last stage (collective over the model: earlier stages send their
    residuals to the last one). batching.compute_top_probs turns them into log-probabilities."""
    g, lay = model.groups, model.groups.layout
    mine = torch.stack([stash[(layer, LENS)] for layer in model.layers])  # (L_stage, B, H)
    if not g.is_last_stage:
        dist.send(mine.contiguous(), g.pp_ranks[-1])
        return None
    parts = []
    for p in range(lay.pp_size - 1):
        buf = torch.empty_like(mine)
        dist.recv(buf, g.pp_ranks[p])
        parts.append(buf)
    residuals = torch.cat(parts + [mine]) if parts else mine  # (L, B, H); a cat of one would copy
    # over the real vocabulary, like the next-token probabilities (padding ids excluded)
    return model.compute_logits(residuals)[..., : model.cfg.vocab_size]


def pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    header = [len(tensors)]
    for t in tensors:
        header += [t.dim(), *t.shape]
    device = tensors[0].device if tensors else "cpu"
    data = torch.cat([t.float().reshape(-1) for t in tensors]) if tensors else torch.empty(0, device=device)
    return torch.tensor(header, dtype=torch.int64, device=device), data


def unpack(header: torch.Tensor, data: torch.Tensor) -> list[torch.Tensor]:
    h, out, i, off = header.tolist(), [], 1, 0
    for _ in range(h[0]):
        ndim = h[i]
        shape = h[i + 1 : i + 1 + ndim]
        i += 1 + ndim
        n = 1
        for s in shape:
            n *= s
        out.append(data[off : off + n].view(shape))
        off += n
    return out


def send_to_serving(tensors: list[torch.Tensor]) -> None:
    header, data = pack(tensors)
    dist.send(torch.tensor([header.numel(), data.numel()], device=header.device), SERVING_RANK)
    dist.send(header, SERVING_RANK)
    if data.numel():
        dist.send(data, SERVING_RANK)


def recv_from(src: int, device) -> list[torch.Tensor]:
    sizes = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(sizes, src)
    header = torch.empty(int(sizes[0]), dtype=torch.int64, device=device)
    dist.recv(header, src)
    data = torch.empty(int(sizes[1]), dtype=torch.float32, device=device)
    if data.numel():
        dist.recv(data, src)
    return unpack(header, data)


def collect_step(
    model, target, layers, sites, stash, want_lens: bool
) -> list[tuple[str, int | None, str, torch.Tensor]] | None:
    """Every rank: gather this step's captures; the serving rank returns all of them
    (name, layer, site, tensor) in layer order, the others None."""
    items = stage_items(target, layers, sites, stash)
    lens = compute_logit_lens(model, stash) if want_lens else None
    if lens is not None:
        items.append(("logit_lens", None, "logit_lens", lens))
    g, lay = model.groups, model.groups.layout
    stage_head = lay.rank_of(0, 0, g.pp_rank)
    if g.rank == SERVING_RANK:
        for p in range(1, lay.pp_size):
            src = lay.rank_of(0, 0, p)
            names = _stage_names(model, p, layers, sites, want_lens)
            items += [(n, l, s, t) for (n, l, s), t in zip(names, recv_from(src, model.device))]
        return items
    if g.rank == stage_head:
        send_to_serving([t for *_, t in items])
    return None


def _stage_names(model, pp_rank: int, layers, sites, want_lens: bool) -> list[tuple[str, int | None, str]]:
    """Names the stage `pp_rank` sends, in order (mirrors stage_items + logit lens)."""
    pp = model.groups.layout.pp_size
    first, last = compute_chunk_layer_ranges(compute_stage_layers(model.cfg.num_layers, pp), pp)[pp_rank][0]
    names = [
        (f"layer{layer}/{site}", layer, site)
        for layer in sorted(set(layers) & set(range(first, last)))
        for site in LAYER_SITES
        if site in sites
    ]
    if want_lens and pp_rank == model.groups.layout.pp_size - 1:
        names.append(("logit_lens", None, "logit_lens"))
    return names
