"""Split backward: a linear's weight-gradient GEMM deferred from its backward to a later W task.

A pipeline stage's backward is two kinds of work: B, the gradient of the stage's input (the
previous stage waits for it), and W, the gradients of its weights (nobody waits for them
until the optimizer step). Zero-bubble schedules (Qi et al., ICLR 2024) and MegaDPP's W
filling run W later, where a rank would otherwise idle. As in Megatron, only the linears'
weight-gradient GEMMs move: a linear switched by `apply_split_backward` computes its input
gradient (and bias gradient) in B and, while a `WeightGradQueue.capture` is active, stores
the GEMM's operands (output gradient, input) under the (chunk, microbatch) being
backpropagated; `WeightGradQueue.run` later pops and runs them, accumulating into the fp32
`main_grad` (engine/grads.py). LayerNorm and bias gradients stay in B (small, elementwise).

Autograd gets no weight gradient from a switched linear (None); its post-accumulate hook still
fires, and engine/grads.py ignores it for weights marked `weight_grad_in_w`. W reports the
weights it finished instead, and the runtime tells the GradReducer when a chunk's last W is
done (its buckets may be reduced then, not before).

Sums: W adds `grad_out^T @ input` to the main grad exactly as autograd's weight gradient is
added (fp32: the same mm, then the same in-place add; bf16/fp16: the GEMM in that dtype then
a widening add; with gradient-accumulation fusion, wgrad_fusion's fused accumulation, first
write included). So with W in the order of the B's the gradients are bit-identical to the
unsplit backward.

Sequence parallelism: the stored input of a column-parallel linear is the all-gathered
sequence (what the forward saved anyway). It is kept rather than re-gathered in W: a
re-gather would put a TP collective into W, so W could run only where every TP rank of the
stage runs it at once, and the filler would stop being free to fill; the memory it holds is
counted in `pending_bytes`.

A backward outside any capture (a plain `loss.backward()` on a switched model) runs its
GEMMs at once. Not for torch.compile: W is plain Python state that a compiled backward would
trace once (the config refuses the combination).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp.parallel.wgrad_fusion import accumulate_weight_grad


@dataclass
class _DeferredGemm:
    weight: nn.Parameter
    grad_out: torch.Tensor  # (T, out)
    inputs: torch.Tensor  # (T, in); with sequence parallelism the gathered sequence
    fused: bool  # gradient-accumulation fusion (wgrad_fusion): first write and fp32 accumulation

    @property
    def operands(self) -> tuple[torch.Tensor, ...]:
        return self.grad_out, self.inputs

    def run(self) -> None:
        main = self.weight.main_grad
        if self.fused:
            accumulate_weight_grad(main, self.grad_out, self.inputs)
        else:  # autograd's weight gradient, then the add its accumulation would do
            main.add_(self.grad_out.t().mm(self.inputs))


class WeightGradQueue:
    """Pending W work of one rank, by (chunk, microbatch), and the bytes it holds."""

    def __init__(self):
        self._pending: dict[tuple[int, int], list] = {}
        self._capturing: tuple[int, int] | None = None
        self.pending_bytes = 0  # distinct storages held by pending operands
        self.peak_bytes = 0
        self._bytes_of: dict[tuple[int, int], int] = {}

    @contextlib.contextmanager
    def capture(self, chunk: int, microbatch: int):
        """Within this context, switched linears defer their weight GEMMs to W(chunk, microbatch)."""
        global _active
        key = (chunk, microbatch)
        if key in self._pending:
            raise RuntimeError(f"W(c{chunk},m{microbatch}) is still pending: its B ran twice")
        previous, _active = _active, self
        self._capturing, self._pending[key] = key, []
        try:
            yield
        finally:
            _active, self._capturing = previous, None
            self._account(key)

    def defer(self, gemm) -> None:
        """Queue `gemm` (`.weight`, `.operands`, `.run()`) under the captured (chunk, microbatch)."""
        self._pending[self._capturing].append(gemm)

    def _account(self, key: tuple[int, int]) -> None:
        storages = {}
        for g in self._pending[key]:
            for t in g.operands:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self._bytes_of[key] = sum(storages.values())
        self.pending_bytes += self._bytes_of[key]
        self.peak_bytes = max(self.peak_bytes, self.pending_bytes)

    def has(self, chunk: int, microbatch: int) -> bool:
        return (chunk, microbatch) in self._pending

    def pending_keys(self) -> list[tuple[int, int]]:
        """(chunk, microbatch) of every pending W, oldest B first."""
        return list(self._pending)

    def run(self, chunk: int, microbatch: int) -> list[nn.Parameter]:
        """Run W(chunk, microbatch): its GEMMs in the order B deferred them; returns their weights."""
        key = (chunk, microbatch)
        if key not in self._pending:
            raise RuntimeError(f"W(c{chunk},m{microbatch}) has no pending work: its B has not run")
        gemms = self._pending.pop(key)
        with torch.no_grad():
            for g in gemms:
                g.run()
        self.pending_bytes -= self._bytes_of.pop(key)
        return [g.weight for g in gemms]


_active: WeightGradQueue | None = None  # the queue whose capture is open (backward is one thread)


def defer_or_run(gemm) -> None:
    """A switched linear's backward hands its weight GEMM here: queued under the open capture,
    or run at once outside any."""
    if _active is not None:
        _active.defer(gemm)
    else:
        with torch.no_grad():
            gemm.run()


class _LinearWithDeferredWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fused: bool):
        ctx.save_for_backward(x, weight)
        # the parameter itself (W reads its main_grad): under non-reentrant recompute the saved
        # weight comes back as a new tensor object without it
        ctx.param, ctx.has_bias, ctx.fused = weight, bias is not None, fused
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        defer_or_run(_DeferredGemm(ctx.param, g2, x.reshape(-1, x.shape[-1]), ctx.fused))
        grad_bias = g2.sum(0) if ctx.has_bias else None
        return grad_out.matmul(weight), None, grad_bias, None


def linear_with_deferred_weight_grad(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fused: bool
) -> torch.Tensor:
    """F.linear whose weight gradient goes to `weight.main_grad` in W (module doc)."""
    return _LinearWithDeferredWeightGrad.apply(x, weight, bias, fused)


def apply_split_backward(modules) -> int:
    """Switch every TP linear among `modules` (they need fp32 main grads: engine/grads.py) to
    deferred weight gradients; returns how many were switched."""
    count = 0
    for m in modules:
        if hasattr(m, "split_backward") and getattr(m.weight, "main_grad", None) is not None:
            m.split_backward = True
            m.weight.weight_grad_in_w = True  # engine/grads.py: its main-grad hook does nothing
            count += 1
    return count
