"""Gradient-accumulation fusion: the weight-gradient GEMM accumulates into the fp32 main grad.

Without it, a bf16 linear's backward writes a bf16 weight gradient, and a hook then adds
it to the fp32 `main_grad` (engine/grads.py): one extra read and write of every weight per
microbatch. With it (Megatron's `gradient_accumulation_fusion`), backward computes
`main_grad += grad_out^T @ input` in one GEMM with bf16 inputs and fp32 accumulation
(`torch.addmm(..., out_dtype=torch.float32)` on CUDA), so the bf16 weight gradient never
exists. Autograd still receives a placeholder weight gradient (uninitialised, no kernel)
so that the per-parameter post-accumulate hook fires and counts the parameter's bucket as
ready; `weight.grad_added_to_main_grad` (set once, when the layer is switched to the fused
path) tells that hook not to add it.

The accumulation is a `torch.library` custom op that declares its mutation of `main_grad`,
so torch.compile keeps the whole block in one graph (no graph break at each linear) and
the bias gradient and neighbouring elementwise work stay fused by Inductor.

First write instead of zeroing: a main grad marked with `mark_first_write` (the engine's
GradReducer does it when a step starts) is *written* by its next weight-gradient GEMM
(beta 0) instead of accumulated into, so the step needs no zeroing pass over the weights'
main grads (5.7 GB of writes a step for a 1.4B model) and the first GEMM reads no fp32 C.
The mark is looked up by address inside the op, which is the one place that runs at run
time under torch.compile (it receives tensors only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# main grads whose next accumulation is the first of a step, by (address, size)
_first_write: set[tuple[int, int]] = set()


def _key(main_grad: torch.Tensor) -> tuple[int, int]:
    return main_grad.data_ptr(), main_grad.numel()


def mark_first_write(main_grads: list[torch.Tensor]) -> None:
    """The next accumulation into each of `main_grads` overwrites it (see module doc)."""
    _first_write.update(_key(g) for g in main_grads)


def take_unwritten(main_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Unmark `main_grads`; returns those still marked, i.e. never written since marked
    (a weight that got no gradient this step: its main grad must read zero)."""
    unwritten = [g for g in main_grads if _key(g) in _first_write]
    _first_write.difference_update(_key(g) for g in unwritten)
    return unwritten


def consume_first_write(main_grad: torch.Tensor) -> bool:
    """True (and unmark it) when this accumulation into `main_grad` is its first of the step."""
    key = _key(main_grad)
    if key in _first_write:
        _first_write.discard(key)
        return True
    return False


def accumulate_weight_grad(main_grad: torch.Tensor, grad_out_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    """main_grad (out, in) fp32 += grad_out_2d^T (out, T) @ input_2d (T, in), accumulated in fp32
    (or = , once after mark_first_write)."""
    beta = 0.0 if consume_first_write(main_grad) else 1.0  # beta 0: C is not read, whatever it holds
    if main_grad.dtype == grad_out_2d.dtype:  # bf16 main grads (--main-grads-dtype bf16), or fp32 throughout
        main_grad.addmm_(grad_out_2d.t(), input_2d, beta=beta)
    elif main_grad.device.type == "cuda":
        torch.addmm(main_grad, grad_out_2d.t(), input_2d, beta=beta, out_dtype=torch.float32, out=main_grad)
    else:  # CPU has no mixed-dtype addmm: same maths, the inputs widened first
        main_grad.addmm_(grad_out_2d.t().float(), input_2d.float(), beta=beta)


@torch.library.custom_op("megatronapp::accumulate_weight_grad", mutates_args=("main_grad",))
def _accumulate_weight_grad_op(main_grad: torch.Tensor, grad_out_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    accumulate_weight_grad(main_grad, grad_out_2d, input_2d)


class _LinearWithGradAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, main_grad):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad  # not saved: other microbatches write it before this backward
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        main_grad = ctx.main_grad
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        torch.ops.megatronapp.accumulate_weight_grad(main_grad, g2, x.reshape(-1, x.shape[-1]))
        placeholder = torch.empty_like(weight)  # never read: the hook drops it (see module doc)
        grad_bias = g2.sum(0) if ctx.has_bias else None
        return grad_out.matmul(weight), placeholder, grad_bias, None


def linear_with_grad_accumulation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear whose weight gradient goes straight into `weight.main_grad` (fp32)."""
    return _LinearWithGradAccumulation.apply(x, weight, bias, weight.main_grad)


def enable_grad_accumulation_fusion(modules) -> int:
    """Switch every linear layer among `modules` whose weight has an fp32 main grad and a
    low-precision dtype to the fused path; returns how many were switched."""
    count = 0
    for m in modules:
        w = getattr(m, "weight", None)
        if (
            hasattr(m, "wgrad_fusion")
            and w is not None
            and getattr(w, "main_grad", None) is not None
            and w.dtype != torch.float32
        ):
            m.wgrad_fusion = True
            w.grad_added_to_main_grad = True  # always, from now on: the main-grad hook only drops .grad
            count += 1
    return count
