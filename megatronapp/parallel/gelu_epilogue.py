"""The MLP's GELU inside its GEMMs' epilogues (`--gelu-epilogue-fusion`).

Compiled torch runs fc1 -> tanh-GELU -> fc2 as cuBLAS GEMMs with Triton kernels between them:
forward, fc1 writes the pre-activation and a kernel reads it back to write the activation;
backward, fc2's input-gradient GEMM writes dL/dact, a kernel reads it with the pre-activation
to write dL/dpre, and fc1's bias gradient is one more pass over that. cuBLASLt does the same
work in two GEMM epilogues (as Transformer Engine's LayerNormMLP does for Megatron):
  GELU_AUX_BIAS  fc1 writes GELU(x W1^T + b1) and, beside it, the pre-activation (the "aux");
  DGELU_BGRAD    fc2's input-gradient GEMM reads that aux and writes dL/dpre, with fc1's bias
                 gradient summed in the same kernel.
That saves about three passes over a (tokens x ffn) tensor per layer and microbatch, but on the
H200 at the 1.3B shapes (8192 tokens, 2048 -> 8192 -> 2048) the two epilogue GEMMs are slower
than the plain ones by more than that saves: 3.07 vs 2.64 ms per MLP forward + backward
(BENCHMARKS.md, 2026-12-04). Off by default; kept for shapes and GPUs where it may pay.

The two epilogue GEMMs are `torch.library` custom ops whose fake implementations give their
shapes, so torch.compile keeps the block one graph. On CUDA they run through nvmath-python
(NVIDIA's binding of cuBLASLt, which torch does not expose for these epilogues): one stateful
Matmul per shape, planned once and reset per call. On CPU the same ops run the same maths in
torch, the reference the tests compare with.

cuBLASLt adds the bias along the result's rows and keeps the aux in the result's
(column-major) layout, so both GEMMs are written transposed: act^T (F, T) = W1 (F, H) @ x^T
(H, T), whose column-major storage is the row-major (T, F) activation the rest of the model
reads, and dpre^T (F, T) = W2^T (F, H') @ dy^T (H', T) reads that same aux.

The core works on this rank's tensors only; the MLP puts fc1's input mapping before it and
fc2's output mapping after it (copy or all-gather, all-reduce or reduce-scatter: layers.py),
as the two linears do apart. With gradient-accumulation fusion the weight gradients go straight
into the fp32 main grads, as in wgrad_fusion.py.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor


def nvmath_unavailable_reason() -> str | None:
    """None when the CUDA path can run here, else why not (one line)."""
    try:
        from nvmath.linalg.advanced import Matmul, MatmulEpilog  # noqa: F401
    except ImportError as e:
        return f"--gelu-epilogue-fusion on CUDA needs nvmath-python (cuBLASLt's epilogues): {e}"
    return None


def _row_major(t: Tensor, what: str) -> Tensor:
    """The (T, F) view of a column-major (F, T) result; a copy, once warned, if cuBLASLt laid it out otherwise."""
    if t.is_contiguous():
        return t
    warnings.warn(f"gelu epilogue: the {what} came back in another layout ({tuple(t.stride())}); copying it",
                  stacklevel=3)
    return t.contiguous()


class _CublasLtEpilogues:
    """nvmath stateful Matmuls, one per (epilogue, shapes, dtype, device): planned on first use
    (cuBLASLt's heuristic picks the kernel), operands reset on every later call."""

    def __init__(self) -> None:
        self._plans: dict[tuple, object] = {}

    @staticmethod
    def _stream(device: torch.device):
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def _execute(self, epilog_name: str, a: Tensor, b: Tensor, inputs: dict):
        from nvmath.linalg.advanced import Matmul, MatmulEpilog

        stream = self._stream(a.device)
        key = (epilog_name, tuple(a.shape), tuple(b.shape), a.dtype, a.device)
        mm = self._plans.get(key)
        if mm is None:
            mm = Matmul(a, b, stream=stream)
            mm.plan(epilog=getattr(MatmulEpilog, epilog_name), epilog_inputs=inputs, stream=stream)
            self._plans[key] = mm
        else:
            mm.reset_operands(a=a, b=b, epilog_inputs=inputs, stream=stream)
        return mm.execute(stream=stream)

    def gelu_aux_bias(self, x: Tensor, w1: Tensor, b1: Tensor) -> tuple[Tensor, Tensor]:
        act_t, aux = self._execute("GELU_AUX_BIAS", w1, x.t(), {"bias": b1})
        (aux_t,) = aux.values()
        return _row_major(act_t.t(), "activation"), _row_major(aux_t.t(), "GELU aux")

    def dgelu_bgrad(self, dy: Tensor, w2: Tensor, aux: Tensor) -> tuple[Tensor, Tensor]:
        dpre_t, out = self._execute("DGELU_BGRAD", w2.t(), dy.t(), {"gelu_aux": aux.t()})
        (bgrad,) = out.values()
        return _row_major(dpre_t.t(), "pre-activation gradient"), bgrad.reshape(-1)


_CUBLASLT = _CublasLtEpilogues()


@torch.library.custom_op("megatronapp::gelu_aux_bias", mutates_args=())
def gelu_aux_bias(x: Tensor, w1: Tensor, b1: Tensor) -> tuple[Tensor, Tensor]:
    """(act, aux): GELU(x w1^T + b1) and x w1^T + b1, both (T, F) row-major."""
    if x.is_cuda:
        return _CUBLASLT.gelu_aux_bias(x, w1, b1)
    pre = torch.addmm(b1, x, w1.t())
    return F.gelu(pre, approximate="tanh"), pre


@gelu_aux_bias.register_fake
def _(x, w1, b1):
    return x.new_empty(x.shape[0], w1.shape[0]), x.new_empty(x.shape[0], w1.shape[0])


@torch.library.custom_op("megatronapp::dgelu_bgrad", mutates_args=())
def dgelu_bgrad(dy: Tensor, w2: Tensor, aux: Tensor) -> tuple[Tensor, Tensor]:
    """(dpre, db1): (dy w2) * GELU'(aux), (T, F) row-major, and its sum over tokens, (F,)."""
    if dy.is_cuda:
        return _CUBLASLT.dgelu_bgrad(dy, w2, aux)
    dpre = torch.ops.aten.gelu_backward(dy @ w2, aux, approximate="tanh")
    return dpre, dpre.sum(0)


@dgelu_bgrad.register_fake
def _(dy, w2, aux):
    return aux.new_empty(aux.shape), aux.new_empty(aux.shape[1])


def _weight_grad(weight: Tensor, main_grad: Tensor | None, grad_out_2d: Tensor, input_2d: Tensor) -> Tensor:
    if main_grad is None:
        return grad_out_2d.t() @ input_2d
    torch.ops.megatronapp.accumulate_weight_grad(main_grad, grad_out_2d, input_2d)
    return torch.empty_like(weight)  # a placeholder the main-grad hook drops (wgrad_fusion.py)


class _EpilogueMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, main_grad1, main_grad2):
        x2 = x.reshape(-1, x.shape[-1])
        act, aux = torch.ops.megatronapp.gelu_aux_bias(x2, w1, b1)
        ctx.save_for_backward(x2, act, aux, w1, w2)
        ctx.main_grads = (main_grad1, main_grad2)  # not saved: other microbatches write them first
        return (act @ w2.t()).view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, act, aux, w1, w2 = ctx.saved_tensors
        main_grad1, main_grad2 = ctx.main_grads
        dy2 = dy.reshape(-1, dy.shape[-1])
        grad_w2 = _weight_grad(w2, main_grad2, dy2, act)
        dpre, grad_b1 = torch.ops.megatronapp.dgelu_bgrad(dy2, w2, aux)
        grad_w1 = _weight_grad(w1, main_grad1, dpre, x2)
        dx = (dpre @ w1).view(*dy.shape[:-1], w1.shape[1])
        return dx, grad_w1, grad_b1, grad_w2, None, None


def epilogue_mlp_core(x: Tensor, fc1, fc2) -> Tensor:
    """GELU(x W1^T + b1) W2^T on this rank's shards (no bias b2, no TP communication): what
    fc2's matmul would give after fc1 and the GELU. fc1, fc2: the MLP's parallel linears."""
    def main_grad(layer):
        return layer.weight.main_grad if layer.wgrad_fusion else None
    return _EpilogueMLP.apply(x, fc1.weight, fc1.bias, fc2.weight, main_grad(fc1), main_grad(fc2))
