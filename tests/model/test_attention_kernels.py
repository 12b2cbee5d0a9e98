"""--attention-backend: every name maps to an SDPA backend, and a recompute replays under the forward's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatronapp.config import ATTENTION_BACKENDS
from megatronapp.model import attention_kernels as ak


def test_every_backend_but_auto_names_an_sdpa_backend():
    assert set(ak._PREFERRED) | {"auto"} == set(ATTENTION_BACKENDS)


@pytest.mark.parametrize("name", ATTENTION_BACKENDS)
def test_sdpa_backends_give_the_same_attention_on_cpu(name):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with ak.attention_backend_context(name):  # the others stay as fallbacks: CPU still runs
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["cudnn", "math"])
def test_a_recompute_replays_under_the_forwards_kernel_preference(name):
    """--attention-backend is set around the forward step only; the replay of a recomputed
    region runs later, in backward. It must see the preference the forward saw, or on CUDA it
    may run another kernel and break recompute's bit-identity. (CPU ignores the priority order,
    so the order itself is what is checked here.)"""
    from megatronapp.model.recompute import recompute

    seen = []

    def region(x):
        seen.append((list(torch._C._get_sdp_priority_order()), ak._held))  # a compiled block guards on the name
        return x.sin()  # saves x: the backward needs the replay

    x = torch.ones(3, requires_grad=True)
    with ak.attention_backend_context(name):
        y = recompute(region, x)
    default = (list(torch._C._get_sdp_priority_order()), ak._held)
    y.sum().backward()
    assert len(seen) == 2 and seen[1] == seen[0] and seen[0][0] != default[0] and seen[0][1] == name
    assert list(torch._C._get_sdp_priority_order()) == default[0] and ak._held == default[1]  # both undone


def test_a_compiled_attention_retraces_when_the_preference_changes():
    """torch.compile does not guard on SDPA's kernel preference: without the engine's guard
    (gpt.Attention calls specialise_on_preference) a second model traced under another
    --attention-backend reuses the first one's graph, and its kernel with it (dynamo's cache is
    per code object, shared by every instance of the class)."""
    from torch._dynamo.testing import CompileCounter

    from megatronapp.config import model_preset
    from megatronapp.model.gpt import Attention, ChunkOptions, TPContext, rotary_tables

    cfg = model_preset("tiny", num_layers=1, seq_length=8)
    x = torch.randn(1, 8, cfg.hidden_size)
    cos, sin = rotary_tables(8, cfg.head_dim, cfg.rotary_base, "cpu")
    torch._dynamo.reset()
    counter = CompileCounter()

    def trace_under(name):
        attn = Attention("a", cfg, TPContext(None, 1, 0), 0, "cpu", ChunkOptions()).eval()
        with ak.attention_backend_context(name):
            torch.compile(attn, backend=counter)(x, cos, sin)

    try:
        trace_under("auto")
        trace_under("math")
        trace_under("math")  # the same preference again: no retrace
        assert counter.frame_count == 2
    finally:
        torch._dynamo.reset()
