"""Which kernel runs the engine's causal attention (`--attention-backend`).

Every backend goes through `F.scaled_dot_product_attention`, so eager, compiled and recomputed
paths and the dropout RNG stay one code path:
  auto                       torch's own choice
  cudnn, flash, efficient,   that SDPA backend first, the others as fallbacks (CPU and
  math                       unsupported shapes still run)

FlashAttention-4 behind SDPA was tried here and dropped (BENCHMARKS.md, session 14): on the H200
its kernels were slower than cuDNN's at the 1.3B shapes; benchmarks/attention_probe.py keeps it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

_PREFERRED = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}  # ATTENTION_BACKENDS but auto


def attention_backend_context(name: str):
    """SDPA kernel preference for a forward: `name`'s SDPA backend first, the others as
    fallbacks; "auto" leaves torch's own choice. Set around the (eager) forward step: compiled
    graphs pick their kernel when traced inside it."""
    if name == "auto":
        return contextlib.nullcontext()
    first = _PREFERRED[name]
    return sdpa_kernel([first] + [b for b in _PREFERRED.values() if b != first], set_priority=True)


def replay_sdpa_preference():
    """torch.utils.checkpoint's context_fn: (forward context, replay context), the replay with the
    SDPA kernel preference that holds now, at the original forward. attention_backend_context
    is set around each forward step only; a recompute replays later, in backward, outside it, and
    a different kernel there would give activations that are close but not bit-identical."""
    from torch.nn.attention import _cur_sdpa_kernel_backends  # the state sdpa_kernel itself saves

    return contextlib.nullcontext(), sdpa_kernel(_cur_sdpa_kernel_backends(with_priority=True), set_priority=True)
