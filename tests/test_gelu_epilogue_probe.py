"""The GELU-epilogue probe's algebra (benchmarks/gelu_epilogue_probe.py) on the CPU: a stand-in
for nvmath's Matmul with cuBLASLt's epilogue semantics (bias along the result's rows, results and
the GELU aux column-major, DGELU_BGRAD's bias gradient summed along the rows) must give the
torch MLP's output and every gradient. What it cannot check is nvmath itself: the probe does
that on the GPU before it times anything."""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gelu_epilogue_probe as probe  # noqa: E402


class _Epilog(enum.Enum):
    GELU_AUX_BIAS = 1
    DGELU_BGRAD = 2


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(F.gelu(x, approximate="tanh").sum(), x)[0]


class _Matmul:
    """D = A @ B with the two epilogues the probe uses, as cuBLASLt defines them."""

    def __init__(self, a, b, stream=None):
        self.a, self.b = a, b

    def plan(self, epilog=None, epilog_inputs=None, stream=None):
        self.epilog, self.inputs = epilog, epilog_inputs

    def reset_operands(self, a=None, b=None, epilog_inputs=None, stream=None):
        self.a, self.b, self.inputs = a, b, epilog_inputs

    def execute(self, stream=None):
        d = self.a @ self.b
        if self.epilog is _Epilog.GELU_AUX_BIAS:
            pre = d + self.inputs["bias"][:, None]
            return _column_major(F.gelu(pre, approximate="tanh")), {"gelu_aux": _column_major(pre)}
        g = d * _gelu_derivative(self.inputs["gelu_aux"])
        return _column_major(g), {"dgelu_bgrad": g.sum(1)}


def test_the_epilogue_mlp_gives_the_torch_mlp_and_its_gradients(monkeypatch):
    advanced = types.ModuleType("nvmath.linalg.advanced")
    advanced.Matmul, advanced.MatmulEpilog = _Matmul, _Epilog
    for name, module in {"nvmath": types.ModuleType("nvmath"), "nvmath.linalg": types.ModuleType("nvmath.linalg"),
                         "nvmath.linalg.advanced": advanced}.items():
        monkeypatch.setitem(sys.modules, name, module)
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
