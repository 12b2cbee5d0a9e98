"""Which kernel runs the engine's causal attention (`--attention-backend`).

Every backend goes through `F.scaled_dot_product_attention`, so eager, compiled and recomputed
paths and the dropout RNG stay one code path:
  auto                       torch's own choice
  cudnn, flash, efficient,   that SDPA backend first, the others as fallbacks (CPU and
  math                       unsupported shapes still run)
  fa4                        SDPA's flash backend with its kernels swapped for FlashAttention-4's
                             CuTe-DSL ones (flash-attn-4; SM 9.0/10.0), through torch's flash
                             attention registry. The swap is process-wide: once activated, every
                             flash-backend SDPA in the process runs FA4, whatever asked for it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

_PREFERRED = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
_SDPA_BACKEND = {**{name: name for name in _PREFERRED}, "fa4": "flash"}  # every ATTENTION_BACKENDS but auto


def fa4_unavailable_reason(device_kind: str, capability: tuple[int, int] | None = None) -> str | None:
    """None when --attention-backend fa4 can run on `device_kind` here, else why not (one line).
    `capability` defaults to the first visible GPU's."""
    if device_kind != "cuda":
        return "--attention-backend fa4 needs CUDA (FlashAttention-4 has no CPU kernels)"
    try:
        from torch.nn.attention import (activate_flash_attention_impl, list_flash_attention_impls,  # noqa: F401
                                        restore_flash_attention_impl)
    except ImportError:
        return f"--attention-backend fa4 needs torch's flash attention registry, which torch {torch.__version__} lacks"
    if "FA4" not in list_flash_attention_impls():
        return f"--attention-backend fa4: torch {torch.__version__} registers no FA4 implementation"
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError as e:
        return f"--attention-backend fa4 needs the flash-attn-4 package ({e})"
    major, minor = capability or torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"--attention-backend fa4 needs compute capability 9.x or 10.x, this GPU has {major}.{minor}"
    return None


def _activate_fa4() -> None:
    from torch.nn.attention import activate_flash_attention_impl, current_flash_attention_impl

    if current_flash_attention_impl() != "FA4":
        activate_flash_attention_impl("FA4")


def attention_backend_context(name: str):
    """SDPA kernel preference for a forward: `name`'s SDPA backend first, the others as
    fallbacks; "auto" leaves torch's own choice. Set around the (eager) forward step: compiled
    graphs pick their kernel when traced inside it. "fa4" activates FA4 on first use."""
    if name == "auto":
        return contextlib.nullcontext()
    if name == "fa4":
        _activate_fa4()
    first = _PREFERRED[_SDPA_BACKEND[name]]
    return sdpa_kernel([first] + [b for b in _PREFERRED.values() if b != first], set_priority=True)


def replay_sdpa_preference():
    """torch.utils.checkpoint's context_fn: (forward context, replay context), the replay with the
    SDPA kernel preference that holds now, at the original forward. attention_backend_context
    is set around each forward step only; a recompute replays later, in backward, outside it, and
    a different kernel there would give activations that are close but not bit-identical."""
    from torch.nn.attention import _cur_sdpa_kernel_backends  # the state sdpa_kernel itself saves

    return contextlib.nullcontext(), sdpa_kernel(_cur_sdpa_kernel_backends(with_priority=True), set_priority=True)
