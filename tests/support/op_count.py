"""Counts the ATen ops a MegaScope capture adds to one decode step, on the CPU.

At batch 1 a decode step is bound by kernel launches, so what a capture recorded into the
CUDA-graph decode step costs is, to first order, how many kernels it adds. `count_decode_step`
runs one static-cache decode step (the body a decode graph holds: the forward plus every
recorder's `record_decode`) under a TorchDispatchMode that counts ATen ops; views and
allocations launch no kernel and are counted apart.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatronapp import scope

ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def _storages(tree) -> set[int]:
    return {
        t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.numel()
    }


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


def count_decode_step(model, cfg_kwargs: dict | None, prompt_len: int = 8, contexts=None):
    """ATen ops of the second decode step's graph body with capture `cfg_kwargs`
    (None: off), or under the capture contexts `contexts()` makes, run eagerly on the static cache."""
    counter = OpCounter()
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
