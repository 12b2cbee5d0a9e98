"""Training-view measurements: per-layer weight/grad norms and the probe prompt forward."""

from __future__ import annotations

import re

import torch

from megatronapp.scope_ui import protocol as P

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_norms(named_params: dict, num_layers: int) -> tuple[list[float], list[float]]:
    """(weight L2 norm, gradient L2 norm) per layer from the layout-independent parameter names."""
    w2, g2 = [0.0] * num_layers, [0.0] * num_layers
    with torch.no_grad():
        for name, p in named_params.items():
            m = _LAYER.search(name)
            if m is None or int(m.group(1)) >= num_layers:
                continue
            i = int(m.group(1))
            w2[i] += float(p.detach().float().pow(2).sum())
            grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
            if grad is not None:
                g2[i] += float(grad.float().pow(2).sum())
    return [v ** 0.5 for v in w2], [v ** 0.5 for v in g2]


def run_probe(trainer, tokenizer, prompt: list[int], iteration: int, hub) -> None:
    """One forward of the probe prompt through the training chunk (eval mode, no grad) with a
    capture; sends the next-token top-k, attention/residual frames and per-layer activation stats."""
    from megatronapp.inference.generate import SamplingConfig, generate
    from megatronapp.inference.model import InferenceModel
    from megatronapp.scope import capture

    (chunk,) = trainer.chunks
    model = InferenceModel(trainer.job.model, trainer.groups, chunk, next(chunk.parameters()).device)
    was_training = chunk.training
    chunk.eval()
    try:
        with torch.no_grad(), capture(model, sites=("attn_probs", "residual", "topk"), topk=5) as cap:
            generate(model, [prompt], SamplingConfig(max_new_tokens=1, stop_on_eod=False),
                     eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size)
    finally:
        chunk.train(was_training)
    decode = tokenizer.decode
    means, stds = [], []
    for item in sorted(cap.items, key=lambda it: (it.site, it.layer or 0)):
        data = item.tensors["data"]
        if item.site == "residual":
            means.append(float(data.float().mean()))
            stds.append(float(data.float().std()))
        if item.site in ("attn_probs", "residual"):
            data = data.contiguous()
            hub.broadcast_tensor(P.TensorHeader(run="probe", step=iteration, site=item.site, layer=item.layer,
                                                dims=list(item.dims), dtype=str(data.dtype).removeprefix("torch."),
                                                shape=list(data.shape), compression=list(item.ops)),
                                 data.numpy().tobytes())
    top = cap.get("topk")[0].tensors
    hub.broadcast(P.Probe(iteration=iteration, prompt_text=[decode([t]) for t in prompt],
                          topk=[P.TopEntry(id=int(i), text=decode([int(i)]), p=float(v))
                                for v, i in zip(top["data"][0], top["indices"][0])],
                          layer_act_mean=means, layer_act_std=stds))
