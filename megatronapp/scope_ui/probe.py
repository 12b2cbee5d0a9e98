"""Training-view measurements: per-layer weight/grad norms and the probe prompt forward."""

from __future__ import annotations

import queue
import re

import torch

from megatronapp.scope_ui import protocol as P

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LayerNorms:
    """Per-layer weight and gradient L2 norms, computed on the parameters' device with no host
    sync: `start()` queues the kernels (two fused foreach norms) and the copy of the (2, L)
    result into a pinned host buffer (from a small pool: no pinned allocation per step);
    `finish(pending)` waits for that copy (any thread), gives the buffer back and returns
    ([weight norms], [grad norms])."""

    def __init__(self, named_params: dict, num_layers: int):
        picked = [
            (int(m.group(1)), p)
            for name, p in named_params.items()
            if (m := _LAYER.search(name)) is not None and int(m.group(1)) < num_layers
        ]
        self.num_layers = num_layers
        self.params = [p for _, p in picked]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.layers = [i for i, _ in picked]
        self.layer_of = torch.tensor(self.layers, dtype=torch.long, device=device)
        self.device = device
        self.free: queue.SimpleQueue = queue.SimpleQueue()  # pinned (2, L) buffers not in flight
        self._grad_index = (None, None)  # (which params had grads, their layer ids on device)

    def _grad_layers(self, which: tuple) -> torch.Tensor:
        if self._grad_index[0] != which:  # the same params have grads every step: one H2D copy
            self._grad_index = (which, torch.tensor([self.layers[i] for i in which], device=self.device))
        return self._grad_index[1]

    def start(self):
        with torch.no_grad():
            sq = torch.zeros(2, self.num_layers, dtype=torch.float32, device=self.device)
            if self.params:
                w = torch.stack(torch._foreach_norm([p.detach() for p in self.params])).float()
                sq[0].index_add_(0, self.layer_of, w * w)
                with_grad = [
                    (i, g)
                    for i, p in enumerate(self.params)
                    if (g := p.grad if p.grad is not None else getattr(p, "main_grad", None)) is not None
                ]
                if with_grad:
                    g = torch.stack(torch._foreach_norm([g for _, g in with_grad])).float()
                    sq[1].index_add_(0, self._grad_layers(tuple(i for i, _ in with_grad)), g * g)
            if sq.is_cuda:
                try:
                    host = self.free.get_nowait()
                except queue.Empty:
                    host = torch.empty(sq.shape, dtype=sq.dtype, pin_memory=True)
                host.copy_(sq, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                return host, event
            return sq, None

    def finish(self, pending) -> tuple[list[float], list[float]]:
        host, event = pending
        if event is not None:
            event.synchronize()
        norms = host.sqrt().tolist()
        if event is not None:
            self.free.put(host)
        return norms[0], norms[1]


def run_probe(trainer, tokenizer, prompt: list[int], iteration: int, hub) -> None:
    """One forward of the probe prompt through the training chunk (eval mode, no grad) with a
    capture; posts the next-token top-k, every layer's attention/residual rows and per-layer
    activation stats (encoded on the server's thread)."""
    from megatronapp.inference.generate import SamplingConfig, generate
    from megatronapp.inference.model import InferenceModel
    from megatronapp.scope import capture
    from megatronapp.scope_ui.outbox import ViewOut

    (chunk,) = trainer.chunks
    model = InferenceModel(trainer.job.model, trainer.groups, chunk, next(chunk.parameters()).device)
    was_training = chunk.training
    chunk.eval()
    try:
        with torch.no_grad(), capture(model, sites=("attn_probs", "residual", "topk"), topk=5) as cap:
            generate(
                model,
                [prompt],
                SamplingConfig(max_new_tokens=1, stop_on_eod=False),
                eod_id=tokenizer.eod_id,
                vocab_size=tokenizer.vocab_size,
            )
    finally:
        chunk.train(was_training)
    decode = tokenizer.decode
    records = [
        ViewOut(
            run="probe",
            step=iteration,
            site=it.site,
            layer=it.layer,
            start=0,
            dims=tuple(it.dims),
            compression=tuple(it.ops),
            data=it.tensors["data"].numpy().copy(),
        )
        for it in cap.items
        if it.site in ("attn_probs", "residual")
    ]
    resid = torch.stack([it.tensors["data"].float() for it in sorted(cap.get("residual"), key=lambda it: it.layer)])
    flat = resid.flatten(1)  # (layers, B*S*H)
    top = cap.get("topk")[0].tensors
    records.append(
        P.Probe(
            iteration=iteration,
            prompt_text=[decode([t]) for t in prompt],
            topk=[
                P.TopEntry(id=int(i), text=decode([int(i)]), p=float(v))
                for v, i in zip(top["data"][0].tolist(), top["indices"][0].tolist())
            ],
            layer_act_mean=flat.mean(1).tolist(),
            layer_act_std=flat.std(1).tolist(),
        )
    )
    hub.post(records)
