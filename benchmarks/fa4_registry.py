"""FlashAttention-4 behind SDPA's flash backend, for the attention probe only.

The engine had this as `--attention-backend fa4` (session 13) and dropped it after the H200
measured it (session 14, BENCHMARKS.md): FA4's Hopper kernels ran causal attention at the
engine's shapes slower than the cuDNN kernel torch already picks, and inside the compiled
engine SDPA never called them. The probe keeps measuring it, so a newer release can be judged.

This module is also what torch's registry imports. torch's FA4 registration (torch 2.11,
`torch.nn.attention._fa4`) imports a module that exposes `_flash_attn_fwd(...) -> (out, lse)`
and `_flash_attn_bwd(...) -> (dq, dk, dv)`: flash-attn-4's own `flash_attn.cute.interface` up
to 4.0.0b19. Later releases return more from the forward (4.0.0b20: four values; 4.0.0b36: out,
lse and three optional tensors), which torch unpacks as two and fails on the first call
(measured on the H200 host, 2026-12-04). The two functions below forward to whichever release
is installed and keep the values torch's contract names. They look the package up at each
call, so a wrapper put on the package's function still sees the call, and they count forward
calls, so a caller can show that FA4 ran rather than assume that activating it made SDPA pick it.
"""

from __future__ import annotations

import functools

import torch

_forward_calls = 0


def forward_calls() -> int:
    return _forward_calls


def _flash_attn_fwd(*args, **kwargs):
    global _forward_calls
    from flash_attn.cute import interface

    _forward_calls += 1
    result = interface._flash_attn_fwd(*args, **kwargs)
    return result[0], result[1]


def _flash_attn_bwd(*args, **kwargs):
    from flash_attn.cute import interface

    result = interface._flash_attn_bwd(*args, **kwargs)
    return result[0], result[1], result[2]


def unavailable_reason() -> str | None:
    """None when FA4 can run behind SDPA here, else why not (one line)."""
    if not torch.cuda.is_available():
        return "FA4 needs CUDA"
    try:
        from torch.nn.attention import register_flash_attention_impl  # noqa: F401
        from torch.nn.attention._fa4 import register_flash_attention_fa4  # noqa: F401
    except ImportError:
        return f"FA4 behind SDPA needs torch's flash attention registry, which torch {torch.__version__} lacks"
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError as e:
        return f"FA4 needs the flash-attn-4 package ({e})"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"FA4 needs compute capability 9.x or 10.x, this GPU has {major}.{minor}"
    return None


def activate() -> None:
    """Swap SDPA's flash kernels for FA4's, through this module (process-wide; torch's
    restore_flash_attention_impl undoes it)."""
    from torch.nn.attention import activate_flash_attention_impl, register_flash_attention_impl
    from torch.nn.attention._fa4 import register_flash_attention_fa4

    register_flash_attention_impl("FA4", register_fn=functools.partial(register_flash_attention_fa4,
                                                                       module_path=__name__))
    activate_flash_attention_impl("FA4")
