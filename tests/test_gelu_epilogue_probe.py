"""The GELU-epilogue probe's algebra (benchmarks/gelu_epilogue_probe.py) on the CPU: with a
stand-in for nvmath's Matmul (tests/nvmath_stand_in.py) it must give the torch MLP's output and
every gradient. What it cannot check is nvmath itself: the probe does
that on the GPU before it times anything."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import nvmath_stand_in

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gelu_epilogue_probe as probe  # noqa: E402


def test_the_epilogue_mlp_gives_the_torch_mlp_and_its_gradients(monkeypatch):
    nvmath_stand_in.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    g = torch.Generator().manual_seed(0)
    tokens, hidden, ffn = 64, 16, 48
    x, dy = (torch.randn(tokens, hidden, generator=g, dtype=torch.float64) for _ in range(2))
    w1 = torch.randn(ffn, hidden, generator=g, dtype=torch.float64) * 0.2
    b1 = torch.randn(ffn, generator=g, dtype=torch.float64) * 0.2
    w2 = torch.randn(hidden, ffn, generator=g, dtype=torch.float64) * 0.2
    b2 = torch.randn(hidden, generator=g, dtype=torch.float64) * 0.2

    mlp = probe.EpilogueMLP(x, w1, b1, w2, b2)
    y, saved = mlp.forward(x, w1, b1, w2, b2)
    grads = mlp.backward(dy, saved, w1, w2)

    leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    ref = probe.torch_mlp(*leaves)
    ref.backward(dy)
    torch.testing.assert_close(y, ref.detach())
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad)
