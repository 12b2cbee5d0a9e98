"""AdamW over fp32 master weights that writes the bf16/fp16 model weights in the same kernel.

Megatron runs Apex's or Transformer Engine's FusedAdam for its mixed-precision optimizer;
TE's keeps the master weights and writes the low-precision copy from the update kernel. Without
it one step is AdamW (read grad, master, m, v; write master, m, v) and then a second pass that
reads every master weight again to write the model weight. Here one Triton kernel per tensor
reads 16 bytes and writes 14 per parameter, and divides the gradient by the clip factor's
reciprocal on the way (as torch's fused AdamW does with `grad_scale`), so clipping costs no pass
of its own either. The state lives in the torch AdamW's `state` dict under its usual names
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


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    @triton.jit
    def _adamw_master_kernel(main_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, model_ptr, step_ptr,
                             grad_scale_ptr, n, lr, beta1, beta2, eps, weight_decay,
                             HAS_GRAD_SCALE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n
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
        tl.store(model_ptr + offs, p.to(model_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _state_of(optimizer: torch.optim.AdamW, main: torch.Tensor) -> dict:
    state = optimizer.state[main]
    if not state:  # as torch's fused AdamW initialises it
        state["step"] = torch.zeros((), dtype=torch.float32, device=main.device)
        state["exp_avg"] = torch.zeros_like(main, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(main, memory_format=torch.preserve_format)
    return state


@torch.no_grad()
def adamw_master_step(optimizer: torch.optim.AdamW, model_view_of: dict[int, torch.Tensor],
                      grad_scale: torch.Tensor | None) -> None:
    """One AdamW step over `optimizer`'s fp32 main params (each with `.grad`), writing each
    updated value also into `model_view_of[id(main)]` (the low-precision model tensor, same
    number of contiguous elements). `grad_scale`: the grads are divided by it (device scalar)."""
    for group in optimizer.param_groups:
        mains = [p for p in group["params"] if p.grad is not None]
        states = [_state_of(optimizer, p) for p in mains]
        if not mains:
            continue
        torch._foreach_add_([s["step"] for s in states], 1.0)
        beta1, beta2 = group["betas"]
        for main, state in zip(mains, states):
            model = model_view_of[id(main)]
            assert main.is_contiguous() and model.is_contiguous() and model.numel() == main.numel()
            n = main.numel()
            _adamw_master_kernel[(triton.cdiv(n, BLOCK),)](
                main, main.grad, state["exp_avg"], state["exp_avg_sq"], model, state["step"],
                grad_scale if grad_scale is not None else main, n, float(group["lr"]), beta1, beta2,
                group["eps"], group["weight_decay"], HAS_GRAD_SCALE=grad_scale is not None,
                BLOCK_SIZE=BLOCK, num_warps=8)
