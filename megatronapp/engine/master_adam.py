"""AdamW over fp32 master weights that writes the bf16/fp16 model weights in the same kernel.

Megatron runs Apex's or Transformer Engine's FusedAdam for its mixed-precision optimizer;
TE's keeps the master weights and writes the low-precision copy from the update kernel. Without
it one step is AdamW (read grad, master, m, v; write master, m, v) and then a second pass that
reads every master weight again to write the model weight. Here one Triton kernel launch per
param group (a multi-tensor apply over a pointer table, as Apex's and TE's multi_tensor_apply;
hundreds of per-tensor launches cost GPU tails and host time) reads 16 bytes and writes 14 per
parameter, and divides the gradient by the clip factor's reciprocal on the way (as torch's
fused AdamW does with `grad_scale`), so clipping costs no pass of its own either. The state lives in the torch AdamW's `state` dict under its usual names
(`exp_avg`, `exp_avg_sq`, `step`), so checkpoints and the torch path read it unchanged.

Used on CUDA when Triton imports; the torch path (engine.mixed_precision) is the reference.
Unlike torch's fused kernel it does not store the clipped gradient back (a 4-byte-per-parameter
write nothing reads during training).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 4096
# columns of a plan's pointer table: the addresses each tensor's update reads and writes
_MAIN, _GRAD, _EXP_AVG, _EXP_AVG_SQ, _MODEL, _STEP = range(6)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    @triton.jit
    def _adamw_master_kernel(table_ptr, numel_ptr, block_tensor_ptr, block_start_ptr, grad_scale_ptr,
                             lr, beta1, beta2, eps, weight_decay, MODEL_DTYPE: tl.constexpr,
                             HAS_GRAD_SCALE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        # one program = one BLOCK_SIZE slice of one tensor; which tensor and where comes from
        # the block table, its addresses from the pointer table (a multi-tensor apply)
        pid = tl.program_id(0)
        t = tl.load(block_tensor_ptr + pid).to(tl.int64)
        row = table_ptr + t * 6
        main_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
        grad_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        exp_avg_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        exp_avg_sq_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        model_ptr = tl.load(row + 4).to(tl.pointer_type(MODEL_DTYPE))
        step_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
        offs = tl.load(block_start_ptr + pid) + tl.arange(0, BLOCK_SIZE)
        mask = offs < tl.load(numel_ptr + t)
        p = tl.load(main_ptr + offs, mask=mask)
        g = tl.load(grad_ptr + offs, mask=mask)
        m = tl.load(exp_avg_ptr + offs, mask=mask)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask)
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
        tl.store(main_ptr + offs, p, mask=mask)
        tl.store(exp_avg_ptr + offs, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
        tl.store(model_ptr + offs, p.to(MODEL_DTYPE, fp_downcast_rounding="rtne"), mask=mask)

    _TRITON_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _state_of(optimizer: torch.optim.AdamW, main: torch.Tensor) -> dict:
    state = optimizer.state[main]
    if not state:  # as torch's fused AdamW initialises it
        state["step"] = torch.zeros((), dtype=torch.float32, device=main.device)
        state["exp_avg"] = torch.zeros_like(main, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(main, memory_format=torch.preserve_format)
    return state


class _GroupPlan:
    """The tables one launch over a param group needs: per tensor its six addresses and size,
    per program its tensor and start. Valid while no tensor of the group is reallocated."""

    def __init__(self, mains: list[torch.Tensor], states: list[dict], models: list[torch.Tensor]):
        device = mains[0].device
        rows, numels, block_tensor, block_start = [], [], [], []
        for i, (main, state, model) in enumerate(zip(mains, states, models)):
            assert main.is_contiguous() and model.is_contiguous() and model.numel() == main.numel()
            assert main.grad.is_contiguous() and main.grad.dtype == torch.float32
            rows.append([main.data_ptr(), main.grad.data_ptr(), state["exp_avg"].data_ptr(),
                         state["exp_avg_sq"].data_ptr(), model.data_ptr(), state["step"].data_ptr()])
            numels.append(main.numel())
            starts = range(0, main.numel(), BLOCK)
            block_tensor.extend([i] * len(starts))
            block_start.extend(starts)
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.block_tensor = torch.tensor(block_tensor, dtype=torch.int32, device=device)
        self.block_start = torch.tensor(block_start, dtype=torch.int64, device=device)
        self.model_dtype = models[0].dtype
        assert all(m.dtype == self.model_dtype for m in models)
        self.keepalive = (mains, states, models)  # the addresses above stay valid while these live
        self.steps = [s["step"] for s in states]


class MasterAdamW:
    """AdamW over `optimizer`'s fp32 main params (each with `.grad`), writing each updated value
    also into `model_view_of[id(main)]` (the low-precision model tensor, same number of contiguous
    elements): one kernel launch per param group. Call `invalidate()` whenever a main param,
    its grad, its Adam state or its model tensor is replaced (e.g. after loading a checkpoint)."""

    def __init__(self, optimizer: torch.optim.AdamW, model_view_of: dict[int, torch.Tensor]):
        self.optimizer, self.model_view_of = optimizer, model_view_of
        self._plans: list[_GroupPlan | None] | None = None

    def invalidate(self) -> None:
        self._plans = None

    def _build_plans(self) -> list[_GroupPlan | None]:
        plans = []
        for group in self.optimizer.param_groups:
            mains = [p for p in group["params"] if p.grad is not None]
            states = [_state_of(self.optimizer, p) for p in mains]
            plans.append(_GroupPlan(mains, states, [self.model_view_of[id(p)] for p in mains]) if mains else None)
        return plans

    @torch.no_grad()
    def step(self, grad_scale: torch.Tensor | None) -> None:
        """`grad_scale`: the grads are divided by it (a device scalar), or None."""
        if self._plans is None:
            self._plans = self._build_plans()
        plans = [(g, plan) for g, plan in zip(self.optimizer.param_groups, self._plans) if plan is not None]
        torch._foreach_add_([s for _, plan in plans for s in plan.steps], 1.0)
        for group, plan in plans:
            beta1, beta2 = group["betas"]
            _adamw_master_kernel[(plan.block_tensor.numel(),)](
                plan.table, plan.numels, plan.block_tensor, plan.block_start,
                grad_scale if grad_scale is not None else plan.numels, float(group["lr"]), beta1, beta2,
                group["eps"], group["weight_decay"], MODEL_DTYPE=_TRITON_DTYPE[plan.model_dtype],
                HAS_GRAD_SCALE=grad_scale is not None, BLOCK_SIZE=BLOCK, num_warps=8)

