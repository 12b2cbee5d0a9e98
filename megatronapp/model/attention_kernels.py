"""Which kernel runs the engine's causal attention (`--attention-backend`).

Every backend goes through `F.scaled_dot_product_attention`, so eager, compiled and recomputed
paths and the dropout RNG stay one code path:
  auto                       torch's own choice
  cudnn, flash, efficient,   that SDPA backend first, the others as fallbacks (CPU and
  math                       unsupported shapes still run)

FlashAttention-4 behind SDPA is not offered: on the H200 its kernels were slower than cuDNN's at
the 1.3B shapes (BENCHMARKS.md, Engine).
"""

from __future__ import annotations

import contextlib

from torch.nn.attention import SDPBackend, sdpa_kernel

_PREFERRED = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}  # ATTENTION_BACKENDS but auto


_held = "auto"  # the --attention-backend name in force now (set with the SDPA state, below)


def attention_backend_context(name: str):
    """SDPA kernel preference for a forward: `name`'s SDPA backend first, the others as
    fallbacks; "auto" leaves torch's own choice. Set around the (eager) forward step: compiled
    graphs pick their kernel when traced inside it, and specialise_on_preference makes them
    retrace when it changes."""
    if name == "auto":
        return _holding(name, contextlib.nullcontext())
    first = _PREFERRED[name]
    return _holding(name, sdpa_kernel([first] + [b for b in _PREFERRED.values() if b != first], set_priority=True))


@contextlib.contextmanager
def _holding(name: str, sdpa_state):
    global _held
    previous, _held = _held, name
    try:
        with sdpa_state:
            yield
    finally:
        _held = previous


def specialise_on_preference() -> None:
    """Call where SDPA runs in code that may be compiled. torch.compile does not guard on SDPA's
    kernel preference: a graph traced under one is reused under another, by any instance of the
    same module class (tests/model/test_attention_kernels.py shows it), so two jobs of one process, or
    two benchmark variants, would silently share a kernel. A branch on the name held here makes
    dynamo guard on it and retrace when it changes; in eager code it is one comparison."""
    if _held not in _PREFERRED and _held != "auto":
        raise AssertionError(f"unknown attention backend {_held!r}")


def replay_sdpa_preference():
    """torch.utils.checkpoint's context_fn: (forward context, replay context), the replay with the
    SDPA kernel preference that holds now, at the original forward. attention_backend_context
    is set around each forward step only; a recompute replays later, in backward, outside it, and
    a different kernel there would give activations that are close but not bit-identical (and a
    compiled block replayed under another held name would retrace)."""
    from torch.nn.attention import _cur_sdpa_kernel_backends  # the state sdpa_kernel itself saves

    now = sdpa_kernel(_cur_sdpa_kernel_backends(with_priority=True), set_priority=True)
    return contextlib.nullcontext(), _holding(_held, now)
