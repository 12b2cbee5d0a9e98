"""A stand-in for nvmath-python's stateful Matmul with the two cuBLASLt epilogues the GELU-epilogue
probe uses (benchmarks/gelu_epilogue_probe.py), as cuBLASLt defines them: the bias runs along
the result's rows, results and the GELU aux come back column-major, and DGELU_BGRAD's bias
gradient is summed along the rows. It lets CPU tests check the layout algebra around nvmath;
nvmath itself is checked on the GPU."""

from __future__ import annotations

import enum
import sys
import types

import torch
import torch.nn.functional as F


class Epilog(enum.Enum):
    GELU_AUX_BIAS = 1
    DGELU_BGRAD = 2


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(F.gelu(x, approximate="tanh").sum(), x)[0]


class Matmul:
    """D = A @ B with GELU_AUX_BIAS or DGELU_BGRAD; counts plans and executions."""

    plans = 0

    def __init__(self, a, b, stream=None):
        self.a, self.b = a, b

    def plan(self, epilog=None, epilog_inputs=None, stream=None):
        type(self).plans += 1
        self.epilog, self.inputs = epilog, epilog_inputs

    def reset_operands(self, a=None, b=None, epilog_inputs=None, stream=None):
        assert a.shape == self.a.shape and b.shape == self.b.shape, "nvmath: reset operands must keep their shapes"
        self.a, self.b, self.inputs = a, b, epilog_inputs

    def execute(self, stream=None):
        d = self.a @ self.b
        if self.epilog is Epilog.GELU_AUX_BIAS:
            pre = d + self.inputs["bias"][:, None]
            return _column_major(F.gelu(pre, approximate="tanh")), {"gelu_aux": _column_major(pre)}
        g = d * _gelu_derivative(self.inputs["gelu_aux"])
        return _column_major(g), {"dgelu_bgrad": g.sum(1)}


def install(monkeypatch) -> type[Matmul]:
    """Make `from nvmath.linalg.advanced import Matmul, MatmulEpilog` find the stand-in."""
    advanced = types.ModuleType("nvmath.linalg.advanced")
    advanced.Matmul, advanced.MatmulEpilog = Matmul, Epilog
    for name, module in {"nvmath": types.ModuleType("nvmath"), "nvmath.linalg": types.ModuleType("nvmath.linalg"),
                         "nvmath.linalg.advanced": advanced}.items():
        monkeypatch.setitem(sys.modules, name, module)
    Matmul.plans = 0
    return Matmul
