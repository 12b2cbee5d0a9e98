"""Kernels a MegaScope capture adds to one decode step: ATen ops on the CPU, kernels on a GPU.

    python benchmarks/scope_op_count.py [--layers 24] [--sites ...] [--compress TEXT] [--out F]
    python benchmarks/scope_op_count.py --ui               # the web UI's captures (scope_ui.runner)
    python benchmarks/scope_op_count.py --device cuda      # the CUDA kernels themselves (profiler)

At batch 1 a decode step is bound by kernel launches, not FLOPs, so what a capture recorded
into the CUDA-graph decode step costs is, to first order, how many kernels it adds. This runs
one static-cache decode step (the body a decode graph holds: the forward plus every recorder's
`record_decode`) under a TorchDispatchMode that counts ATen ops, with capture off and on, in
bf16 (so dtype casts are counted as they are on the GPU). Views and allocations launch no
kernel and are listed apart. An ATen op is one kernel on the CPU; on CUDA a few (top-k, a
scatter with include_self=False) launch two or three, so the GPU figure is a little higher.
The model is the `1.3b` preset's depth (24 layers) at a small width: op counts do not depend
on the width. Deterministic: no repeats needed.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from contextlib import ExitStack

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatronapp import scope
from megatronapp.config import model_preset
from megatronapp.inference.model import build_inference_model
from megatronapp.parallel.groups import single_process_groups
from megatronapp.scope import compress
from megatronapp.scope.compress import DEFAULT_COMPRESS
from megatronapp.scope.sites import DEFAULT_SITES
from megatronapp.files import write_text_atomic

ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.numel()}


class OpCounter(TorchDispatchMode):
    """Counts ATen ops by name: kernels (the op writes memory: in place, into out=, or a new
    tensor) apart from views and allocations (the result aliases an input, or is uninitialised).
    A `to` / `contiguous` / `reshape` counts as a kernel exactly when it copies."""

    def __init__(self):
        super().__init__()
        self.kernels, self.no_kernel = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        writes = func._schema.is_mutable or bool(_storages(out) - _storages((args, kwargs)))
        (self.kernels if writes and name not in ALLOCATIONS else self.no_kernel)[name] += 1
        return out


class CudaKernelCounter:
    """On a GPU: the kernels (and memcpy / memset) the step launched, by name, from the
    profiler's device events; what a decode graph replays."""

    def __init__(self):
        self.kernels, self.no_kernel = Counter(), Counter()
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                       torch.profiler.ProfilerActivity.CUDA])

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.prof.__exit__(*exc)
        for event in self.prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                self.kernels[event.name[:48]] += 1


def count_decode_step(model, cfg_kwargs: dict | None, prompt_len: int = 8, contexts=None):
    """Ops (kernels on a GPU) of the second decode step's graph body with capture `cfg_kwargs`
    (None: off), or under the capture contexts `contexts()` makes, run eagerly on the static cache."""
    counter = CudaKernelCounter() if model.device.type == "cuda" else OpCounter()
    body = model._decode_body

    def counted(x, recorders):
        with counter:
            return body(x, recorders)

    model.start(1, prompt_len + 4, torch.zeros(1, dtype=torch.long), static=True)
    tokens = torch.arange(1, prompt_len + 1)[None]
    if contexts is None:
        contexts = lambda: [scope.capture(model, **cfg_kwargs)] if cfg_kwargs is not None else []
    with ExitStack() as stack:
        caps = [stack.enter_context(c) for c in contexts()]
        model.forward_step(tokens)  # prefill (hook path)
        model.forward_step(tokens[:, -1:])  # first decode step: warms memoised tables
        model._decode_body = counted
        try:
            model.forward_step(tokens[:, -1:])
        finally:
            del model._decode_body
        for cap in caps:
            assert cap.recorded_steps == [1, 2], "this capture is not recorded into the decode step"
    return counter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--sites", nargs="+", default=list(DEFAULT_SITES))
    p.add_argument("--compress", default=DEFAULT_COMPRESS)
    p.add_argument("--ui", action="store_true", help="count the web UI's captures (layer 0 shown) instead of --sites")
    p.add_argument("--device", default="cpu", help="cuda: count the CUDA kernels instead (profiler)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    compress.FUSED_ABSMAX_DEVICES = ("cuda", "cpu")  # the ops the GPU runs (one absmax kernel)
    cfg = model_preset("1.3b", num_layers=args.layers, hidden_size=128, num_attention_heads=16, seq_length=64,
                       vocab_size=50304)
    if args.device == "cuda":  # real width: kernel choice (e.g. top-k's multi-block path) depends on it
        cfg = model_preset("1.3b", num_layers=args.layers, vocab_size=50304)
    model = build_inference_model(cfg, single_process_groups(), args.device, seed=0, dtype=torch.bfloat16)
    off = count_decode_step(model, None)
    if args.ui:
        from megatronapp.scope_ui.runner import stream_captures

        args.sites, args.compress = ["ui"], "ui"
        on = count_decode_step(model, None, contexts=lambda: stream_captures(model, (0,), True, 1 << 34))
    else:
        on = count_decode_step(model, dict(sites=args.sites, compress=args.compress))
    added = on.kernels.copy()
    added.subtract(off.kernels)
    report = {"device": args.device, "layers": args.layers, "sites": args.sites, "compress": args.compress,
              "kernels_off": sum(off.kernels.values()), "kernels_on": sum(on.kernels.values()),
              "kernels_added": sum(on.kernels.values()) - sum(off.kernels.values()),
              "added_by_op": {k: v for k, v in sorted(added.items()) if v},
              "views_added": sum(on.no_kernel.values()) - sum(off.no_kernel.values())}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        write_text_atomic(args.out, text)


if __name__ == "__main__":
    main()
