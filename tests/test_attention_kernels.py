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
        seen.append(list(torch._C._get_sdp_priority_order()))
        return x.sin()  # saves x: the backward needs the replay

    x = torch.ones(3, requires_grad=True)
    with ak.attention_backend_context(name):
        y = recompute(region, x)
    default = list(torch._C._get_sdp_priority_order())
    y.sum().backward()
    assert len(seen) == 2 and seen[1] == seen[0] != default
    assert list(torch._C._get_sdp_priority_order()) == default  # and the replay's preference is undone
