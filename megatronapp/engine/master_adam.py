"""AdamW over fp32 master weights that writes the bf16/fp16 model weights in the same kernel.

Megatron runs Apex's or Transformer Engine's FusedAdam for its mixed-precision optimizer;
TE's keeps the master weights and writes the low-precision copy from the update kernel. Without
it one step is AdamW (read grad, master, m, v; write master, m, v) and then a second pass that
reads every master weight again to write the model weight. Here one Triton kernel launch per
param group (a multi-tensor apply over a pointer table, as Apex's and TE's multi_tensor_apply;
hundreds of per-tensor launches cost GPU tails and host time) reads 16 bytes and writes 14 per
parameter, and divides the gradient by the clip factor's reciprocal on the way (as torch's
fused AdamW does with `grad_scale`), so clipping costs no pass of its own either. The state
lives in the torch AdamW's `state` dict under its usual names (`exp_avg`, `exp_avg_sq`,
`step`), so checkpoints and the torch path read it unchanged.

Used on CUDA when Triton imports; the torch path (engine.mixed_precision) is the reference.
Unlike torch's fused kernel it does not store the clipped gradient back (a 4-byte-per-parameter
write nothing reads during training).

The precision-aware optimizer (engine/precision_adam.py, its torch path the reference) runs
the same kernel: masters and moments are read in their stored dtypes and widened, and stored
rounded to nearest even; with remainders the master is rebuilt from the bf16 model weight and
its int16 remainder and split again after the update (2 + 2 bytes read and written instead of
4 + 2), so a bf16 weight, remainder, bf16 moments and fp32 grad read 12 bytes and write 10.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# elements per program and warps per program: 3.85 TB/s on the H200 for the 1.3B preset (BENCHMARKS.md, Engine)
BLOCK = 4096
NUM_WARPS = 8
# a plan's pointer table has one row per tensor: the addresses of its main param, grad, exp_avg,
# exp_avg_sq, model tensor and step counter (the kernel reads them as columns 0-5)
_STEP = 5


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _address(row, column, base, ALIGNED: tl.constexpr):
        """Column `column` of a pointer-table row as a pointer of `base`'s type. It is built as
        `base + index`: Triton tracks alignment through a hinted index, not through an address
        loaded from memory, and without it every access is a scalar one (a quarter of the
        bandwidth). ALIGNED: the plan has checked that every address is 16-byte aligned."""
        elem_bytes: tl.constexpr = base.dtype.element_ty.primitive_bitwidth // 8
        index = (tl.load(row + column) - base.to(tl.int64, bitcast=True)) // elem_bytes
        if ALIGNED:
            index = tl.multiple_of(index, 16 // elem_bytes)
        return base + index

    @triton.jit
    def _store_rounded(ptr, x, mask):
        """Store fp32 `x` in `ptr`'s dtype, rounded to nearest even."""
        if ptr.dtype.element_ty == tl.float32:
            tl.store(ptr, x, mask=mask)
        else:
            tl.store(ptr, x.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _load_master(main_ptr, model_ptr, offs, mask, REMAINDER: tl.constexpr):
        """The fp32 master: stored, or rebuilt from the bf16 weight and its int16 remainder
        (engine/precision_adam.py join_master)."""
        if REMAINDER:
            low = tl.load(main_ptr + offs, mask=mask).to(tl.int32)
            high = tl.load(model_ptr + offs, mask=mask).to(tl.int16, bitcast=True).to(tl.int32)
            high = high - (low < 0).to(tl.int32)
            return ((high << 16) | (low & 0xFFFF)).to(tl.float32, bitcast=True)
        return tl.load(main_ptr + offs, mask=mask).to(tl.float32)

    @triton.jit
    def _store_master(main_ptr, model_ptr, offs, mask, p, REMAINDER: tl.constexpr):
        """The updated master and the model weight (split_master with remainders)."""
        if REMAINDER:
            bits = p.to(tl.int32, bitcast=True)
            low = (bits << 16) >> 16
            high = (bits >> 16) + (low < 0).to(tl.int32)
            tl.store(main_ptr + offs, low.to(tl.int16), mask=mask)
            tl.store(model_ptr + offs, high.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            _store_rounded(main_ptr + offs, p, mask)
            _store_rounded(model_ptr + offs, p, mask)

    @triton.jit
    def _adamw_master_kernel(
        table_ptr,
        numel_ptr,
        block_tensor_ptr,
        block_start_ptr,
        grad_scale_ptr,
        skip_ptr,
        grad_base,
        step_base,
        model_base,
        main_base,
        exp_avg_base,
        exp_avg_sq_base,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        HAS_GRAD_SCALE: tl.constexpr,
        HAS_SKIP: tl.constexpr,
        ALIGNED: tl.constexpr,
        REMAINDER: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        # one program = one BLOCK_SIZE slice of one tensor; which tensor and where comes from
        # the block table, its addresses from the pointer table (a multi-tensor apply)
        pid = tl.program_id(0)
        t = tl.load(block_tensor_ptr + pid).to(tl.int64)
        row = table_ptr + t * 6
        main_ptr = _address(row, 0, main_base, ALIGNED)  # with REMAINDER: the int16 remainders
        grad_ptr = _address(row, 1, grad_base, ALIGNED)
        exp_avg_ptr = _address(row, 2, exp_avg_base, ALIGNED)
        exp_avg_sq_ptr = _address(row, 3, exp_avg_sq_base, ALIGNED)
        model_ptr = _address(row, 4, model_base, ALIGNED)
        step_ptr = _address(row, 5, step_base, False)
        start = tl.load(block_start_ptr + pid)
        numel = tl.load(numel_ptr + t)
        if HAS_SKIP:  # a non-finite step (the device flag is 1): no element, every access masked off
            numel = tl.where(tl.load(skip_ptr) == 0.0, numel, 0)
        if ALIGNED:  # and every size a multiple of 16: the mask is constant over vectors
            start = tl.multiple_of(start, BLOCK_SIZE)
            numel = tl.multiple_of(numel, 16)
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < numel
        p = _load_master(main_ptr, model_ptr, offs, mask, REMAINDER)
        g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
        m = tl.load(exp_avg_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask).to(tl.float32)
        if HAS_GRAD_SCALE:
            g = tl.div_rn(g, tl.load(grad_scale_ptr))
        step = tl.load(step_ptr)  # already counts this update
        bias_correction1 = 1.0 - tl.exp(step * tl.log(beta1))
        bias_correction2 = 1.0 - tl.exp(step * tl.log(beta2))
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p * (1.0 - lr * weight_decay)
        # IEEE-rounded sqrt and division (tl.sqrt and / are approximate), as torch's kernel computes
        denom = tl.div_rn(tl.sqrt_rn(v), tl.sqrt_rn(bias_correction2)) + eps
        p = p - (lr / bias_correction1) * tl.div_rn(m, denom)
        _store_master(main_ptr, model_ptr, offs, mask, p, REMAINDER)
        _store_rounded(exp_avg_ptr + offs, m, mask)
        _store_rounded(exp_avg_sq_ptr + offs, v, mask)


def advance_step_counters(counters: list[torch.Tensor], skip: torch.Tensor | None) -> None:
    """Adam's step counters + 1, or + 0 where the device flag `skip` is 1 (no host sync).

    The increment goes in as a tensor through the Tensor overload by name: `_foreach_sub_` has
    none, and the Python binding turns a 0-dim tensor argument into a Scalar by reading it on
    the host, which made every step wait for the device (and the overlapped update's side
    stream with it)."""
    if skip is None:
        torch._foreach_add_(counters, 1.0)
    else:
        torch.ops.aten._foreach_add_.Tensor(counters, 1.0 - skip)


def _state_of(optimizer: torch.optim.Optimizer, main: torch.Tensor) -> dict:
    if hasattr(optimizer, "init_state"):  # the precision-aware optimizer's own dtypes
        return optimizer.init_state(main)
    state = optimizer.state[main]
    if not state:  # as torch's fused AdamW initialises it
        state["step"] = torch.zeros((), dtype=torch.float32, device=main.device)
        state["exp_avg"] = torch.zeros_like(main, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(main, memory_format=torch.preserve_format)
    return state


class _GroupPlan:
    """The tables one launch over a param group needs: per tensor its six addresses and size,
    per program its tensor and start. Valid while no tensor of the group is reallocated.
    `stored`: per tensor what column 0 names (the master, or its remainder)."""

    def __init__(
        self,
        stored: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict],
        models: list[torch.Tensor],
        block: int,
    ):
        device = stored[0].device
        rows, numels, block_tensor, block_start = [], [], [], []
        for i, (main, grad, state, model) in enumerate(zip(stored, grads, states, models)):
            assert main.is_contiguous() and model.is_contiguous() and model.numel() == main.numel()
            assert grad.is_contiguous() and grad.dtype in (torch.float32, torch.bfloat16)
            rows.append(
                [
                    main.data_ptr(),
                    grad.data_ptr(),
                    state["exp_avg"].data_ptr(),
                    state["exp_avg_sq"].data_ptr(),
                    model.data_ptr(),
                    state["step"].data_ptr(),
                ]
            )
            numels.append(main.numel())
            starts = range(0, main.numel(), block)
            block_tensor.extend([i] * len(starts))
            block_start.extend(starts)
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.block_tensor = torch.tensor(block_tensor, dtype=torch.int32, device=device)
        self.block_start = torch.tensor(block_start, dtype=torch.int64, device=device)
        self.model_dtype = models[0].dtype
        assert all(m.dtype == self.model_dtype for m in models)
        # 16-byte aligned tensors whose sizes are multiples of 16 (all but odd-sized slices of a
        # flat buffer) get vector access
        self.aligned = all(address % 16 == 0 for row in rows for address in row[:_STEP]) and all(
            n % 16 == 0 for n in numels
        )
        self.block = block
        self.grad_base, self.step_base = grads[0], states[0]["step"]
        self.model_base, self.main_base = models[0], stored[0]
        assert all(g.dtype == self.grad_base.dtype for g in grads)
        self.exp_avg_base, self.exp_avg_sq_base = states[0]["exp_avg"], states[0]["exp_avg_sq"]
        for key, base in (("exp_avg", self.exp_avg_base), ("exp_avg_sq", self.exp_avg_sq_base)):
            assert all(s[key].dtype == base.dtype for s in states)
        assert all(t.dtype == self.main_base.dtype for t in stored)
        self.keepalive = (stored, grads, states, models)  # the addresses above stay valid while these live
        self.steps = [s["step"] for s in states]


class MasterAdamW:
    """AdamW over `optimizer`'s fp32 main params (each with `.grad`), writing each updated value
    also into `model_view_of[id(main)]` (the low-precision model tensor, same number of contiguous
    elements): one kernel launch per param group. Call `invalidate()` whenever a main param,
    its grad, its Adam state or its model tensor is replaced (e.g. after loading a checkpoint).
    `only`: ids of the main params this instance updates (default: all of the optimizer's), so
    that disjoint instances can update a model piece by piece (engine/overlap_update.py).
    The precision-aware optimizer (engine/precision_adam.py) passes its `grad_of` (id(main) ->
    fp32 grad) and, with remainders, its bf16 model weights as the mains (each its own model view)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model_view_of: dict[int, torch.Tensor],
        *,
        block: int = BLOCK,
        num_warps: int = NUM_WARPS,
        only: set[int] | None = None,
        grad_of: dict[int, torch.Tensor] | None = None,
        remainders: bool = False,
    ):
        self.optimizer, self.model_view_of = optimizer, model_view_of
        self.grad_of, self.remainders = grad_of, remainders
        self.block, self.num_warps = block, num_warps
        self.only = only
        self._plans: list[_GroupPlan | None] | None = None

    def invalidate(self) -> None:
        self._plans = None

    def _build_plans(self) -> list[_GroupPlan | None]:
        plans = []
        for group in self.optimizer.param_groups:
            mains = [
                p for p in group["params"] if self._grad(p) is not None and (self.only is None or id(p) in self.only)
            ]
            states = [_state_of(self.optimizer, p) for p in mains]
            models = [self.model_view_of[id(p)] for p in mains]
            stored = [s["param_remainder"] for s in states] if self.remainders else mains
            grads = [self._grad(p) for p in mains]
            plans.append(_GroupPlan(stored, grads, states, models, self.block) if mains else None)
        return plans

    def _grad(self, main: torch.Tensor) -> torch.Tensor | None:
        return main.grad if self.grad_of is None else self.grad_of.get(id(main))

    @torch.no_grad()
    def step(self, grad_scale: torch.Tensor | None, skip: torch.Tensor | None = None) -> None:
        """`grad_scale`: the grads are divided by it (a device scalar), or None. `skip`: a
        0-dim fp32 device flag; 1 leaves every tensor and step counter as it was."""
        advance_step_counters(self.step_counters(), skip)
        self.launch(grad_scale, skip)

    def _group_plans(self) -> list[tuple[dict, _GroupPlan]]:
        if self._plans is None:
            self._plans = self._build_plans()
        return [(g, plan) for g, plan in zip(self.optimizer.param_groups, self._plans) if plan is not None]

    def step_counters(self) -> list[torch.Tensor]:
        """The Adam `step` tensors of the params updated here (the kernel reads them advanced)."""
        return [s for _, plan in self._group_plans() for s in plan.steps]

    @torch.no_grad()
    def launch(self, grad_scale: torch.Tensor | None, skip: torch.Tensor | None = None) -> None:
        """The update kernels alone, on the current stream; the step counters already advanced."""
        for group, plan in self._group_plans():
            beta1, beta2 = group["betas"]
            _adamw_master_kernel[(plan.block_tensor.numel(),)](
                plan.table,
                plan.numels,
                plan.block_tensor,
                plan.block_start,
                grad_scale if grad_scale is not None else plan.numels,
                skip if skip is not None else plan.numels,
                plan.grad_base,
                plan.step_base,
                plan.model_base,
                plan.main_base,
                plan.exp_avg_base,
                plan.exp_avg_sq_base,
                float(group["lr"]),
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                HAS_GRAD_SCALE=grad_scale is not None,
                HAS_SKIP=skip is not None,
                ALIGNED=plan.aligned,
                REMAINDER=self.remainders,
                BLOCK_SIZE=plan.block,
                num_warps=self.num_warps,
            )
