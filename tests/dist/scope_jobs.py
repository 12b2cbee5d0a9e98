"""MegaScope jobs run in one process or in cluster workers (capture / perturb on any layout)."""

from __future__ import annotations

import torch
from inference_jobs import PROMPTS, load_model

from megatronapp import scope
from megatronapp.inference.generate import SamplingConfig, generate

ALL_SITES = ("q", "k", "v", "attn_probs", "attn_out", "fc1", "mlp_out", "residual", "topk", "logit_lens")


def capture_job(
    rank: int, world: int, tp: int, pp: int, load_dir: str, sites=ALL_SITES, specs=(), steps: int = 3
) -> dict:
    """Greedy generation of PROMPTS under `specs` while capturing `sites`; rank 0 returns
    {"tokens", "items": {name: fp32 data}, "params_restored"}; other ranks {"params_restored"}."""
    model = load_model(rank, world, tp, pp, load_dir)
    before = {n: p.detach().clone() for n, p in model.chunk.named_parameters()}
    handles = [scope.perturb(model, spec) for spec in specs]
    with scope.capture(model, sites=sites) as cap:
        res = generate(model, PROMPTS, SamplingConfig(max_new_tokens=steps), eod_id=256, vocab_size=257)
    for h in handles:
        h.remove()
    restored = all(
        torch.equal(p.view(torch.int32), before[n].view(torch.int32)) for n, p in model.chunk.named_parameters()
    )
    out = {"params_restored": restored, "tokens": res.tokens}
    if model.is_serving_rank:
        out["items"] = {it.name: {k: t.clone() for k, t in it.tensors.items()} for it in cap.items}
    return out
