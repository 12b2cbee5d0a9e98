"""Megatron-Core's precision-aware optimizer: AdamW whose master weights and moments are stored
at chosen precisions and updated in fp32 (--use-precision-aware-optimizer, --main-params-dtype,
--exp-avg-dtype, --exp-avg-sq-dtype).

Every update widens what it reads to fp32, runs torch's AdamW arithmetic (the same operations
in the same order as torch's single-tensor AdamW, so an all-fp32 configuration updates bit for
bit like torch.optim.AdamW) and rounds what it stores to nearest even.

Master weights as remainders (Transformer Engine FusedAdam's `store_param_remainders`): with a
bf16 model and fp32 masters, the master is not stored whole. Its high 16 bits, rounded up in
magnitude when the low 16 bits are 0x8000 or more (the low half read as a signed int16 is
negative), are the bf16 model weight; the low 16 bits are kept as an int16 remainder. The map
is a bijection of 32-bit patterns, so the fp32 master is rebuilt exactly (fp32 master
semantics) from 2 + 2 bytes instead of 2 + 4. The bf16 weight it yields is the master rounded
to nearest with ties away from zero: it equals the round-to-nearest-even copy of a separate
fp32 master except on exact ties (low half 0x8000), where it is one ulp larger in magnitude.
No rounding rule that is round-to-nearest-even everywhere leaves room for a 16-bit remainder:
65,537 fp32 patterns round to an even bf16 value.

This is the reference implementation (the CPU's, and the GPU's fallback): one tensor at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class StatePrecision:
    """How the optimizer stores a main param's state (all updated in fp32)."""

    main_params: torch.dtype = torch.float32  # separate masters; ignored with param_remainders
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32
    param_remainders: bool = False  # the main param is the bf16 model weight + an int16 remainder


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master -> (bf16 weight, int16 remainder), the exact inverse of join_master."""
    bits = master.contiguous().view(torch.int32)
    low = (bits << 16) >> 16  # the low half, sign-extended: negative when it is >= 0x8000
    high = (bits >> 16) + (low < 0).to(torch.int32)  # rounded up in magnitude
    high = (high << 16) >> 16  # back into int16's range (wraps only for NaN patterns)
    return high.to(torch.int16).view(torch.bfloat16), low.to(torch.int16)


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 weight, int16 remainder) -> the fp32 master they store."""
    low = remainder.to(torch.int32)
    high = weight.contiguous().view(torch.int16).to(torch.int32) - (low < 0).to(torch.int32)
    return ((high << 16) | (low & 0xFFFF)).view(torch.float32)


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float | torch.Tensor,
    group: dict,
) -> None:
    """One AdamW update of fp32 tensors in place, operation for operation as torch's
    single-tensor AdamW (decoupled weight decay; `step` already counts this update). A device
    tensor `step` (no host read) computes the step size on the device."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    if torch.is_tensor(step_size):
        param.sub_(exp_avg / denom * step_size)
    else:
        param.addcdiv_(exp_avg, denom, value=-step_size)


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW over main params stored as `precision` says (see the module docstring).

    With `precision.param_remainders` each param is the bf16 model weight itself and the state
    holds its `param_remainder`; otherwise each param is a master of dtype `precision.main_params`.
    `grad_of`: id(param) -> its fp32 main grad (a tensor's `.grad` must share its dtype). State per param: `step` (0-dim fp32), `exp_avg` and
    `exp_avg_sq` (their dtypes), and the remainder. Read and write masters and moments in fp32
    through master_value/load_master and moment_value/load_moment."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        precision: StatePrecision,
        grad_of: dict[int, torch.Tensor],
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.precision, self.grad_of = precision, grad_of

    def init_state(self, p: torch.Tensor) -> dict:
        """`p`'s state, its missing entries created as zeros (a loaded state brings no remainder)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros(p.shape, dtype=self.precision.exp_avg, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=self.precision.exp_avg_sq, device=p.device)
        if self.precision.param_remainders and "param_remainder" not in state:
            state["param_remainder"] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)
        return state

    def master_value(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master of `p` (a new tensor, or `p` itself where it is fp32)."""
        if self.precision.param_remainders:
            return join_master(p.detach(), self.init_state(p)["param_remainder"]).view(p.shape)
        return p.detach().float()

    def load_master(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Store an fp32 master into `p` (and its remainder)."""
        if self.precision.param_remainders:
            weight, remainder = split_master(master.float())
            p.detach().copy_(weight.view(p.shape))
            self.init_state(p)["param_remainder"].copy_(remainder.view(p.shape))
        else:
            p.detach().copy_(master)

    @torch.no_grad()
    def step(self, grad_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
        """`grad_scale`: each grad is divided by it first (a device scalar, the clip divisor) or None.
        `skip`: a 0-dim fp32 flag; 1 keeps every tensor and step counter (selected on the device)."""
        for group in self.param_groups:
            for p in group["params"]:
                self._update(p, group, grad_scale, skip)

    def _update(self, p: torch.Tensor, group: dict, grad_scale, skip) -> None:
        state = self.init_state(p)
        grad = self.grad_of[id(p)]
        grad = grad.float() if grad_scale is None else grad.float() / grad_scale
        master = self.master_value(p).clone()
        # fp32 copies: the stored moments stay as they were until the (maybe skipped) write below
        exp_avg = state["exp_avg"].to(torch.float32, copy=True)
        exp_avg_sq = state["exp_avg_sq"].to(torch.float32, copy=True)
        step = state["step"] + (1.0 if skip is None else 1.0 - skip)
        # the CPU computes the step size on the host, as torch's AdamW; a GPU keeps it on the device
        count = float(state["step"]) + 1.0 if p.device.type == "cpu" else state["step"] + 1.0
        adamw_update_(master, grad, exp_avg, exp_avg_sq, count, group)
        if skip is not None:  # no host read of the flag: the old values are selected back
            keep = skip > 0
            master = torch.where(keep, self.master_value(p), master)
            exp_avg = torch.where(keep, state["exp_avg"].float(), exp_avg)
            exp_avg_sq = torch.where(keep, state["exp_avg_sq"].float(), exp_avg_sq)
        state["step"].copy_(step)
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)
        self.load_master(p, master)


def build_precision_adamw(
    params: list[tuple[torch.Tensor, bool]], cfg, precision: StatePrecision, grad_of: dict[int, torch.Tensor]
) -> PrecisionAwareAdamW:
    """PrecisionAwareAdamW over (tensor, decays) pairs with Megatron's two weight-decay groups
    (biases and norm weights, the 1-D params, without decay as in engine.optim.build_adamw)."""
    decay = [t for t, d in params if d]
    no_decay = [t for t, d in params if not d]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return PrecisionAwareAdamW(
        [g for g in groups if g["params"]] or [{"params": []}],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        precision=precision,
        grad_of=grad_of,
    )
