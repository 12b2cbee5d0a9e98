"""FP8 GEMMs for the tensor-parallel linears: Megatron's `--fp8-format` with the tensorwise recipe.

Each linear of a transformer block runs its three GEMMs in FP8 through `torch._scaled_mm`
(cuBLASLt on Hopper and later; a reference kernel on the CPU, so the tests run the same
code): forward y = x W^T with x and W in E4M3, backward dgrad = g W and wgrad = g^T x with
the output gradient g in E5M2 (`hybrid`, Megatron's usual choice: gradients need range more
than precision) or E4M3 (`e4m3`). Outputs and everything between the GEMMs (LayerNorm,
attention, GELU, residuals) stay in the model's bf16/fp16; the input embedding and the
output layer stay bf16 as in Transformer Engine's default.

Recipes (Megatron's `--fp8-recipe`):

* `tensorwise` ("current scaling"): each operand gets one scale from its own amax, computed
  when it is cast, so there is no amax history to carry and nothing FP8-specific in a
  checkpoint. The cost: every operand is read twice, once for its amax and once to cast.
* `delayed` (Megatron's default, Transformer Engine's DelayedScaling): an operand is cast
  with a scale known before it exists, from the amaxes of earlier steps
  (`--fp8-amax-history-len` steps, the `most_recent` or the `max`, `--fp8-margin` powers of
  two of headroom), and clamped to the format's range. Its own amax is only recorded, so under
  torch.compile the cast can fuse into the kernel that produces the operand. The recorded
  amaxes are max-reduced once per step over TP and DP (`update_delayed_scaling`), so every rank
  of every layout gets the scales one process would compute from the same global batch. The
  history and scales are saved in checkpoints (`delayed_state_dict`). The first step, which has
  no history, runs current scaling. A step whose amax is not finite or is zero keeps the old scale,
  as Transformer Engine does, so an fp16 overflow step cannot poison the scales.

Two choices of ours, for both:

* Scales are powers of two (the largest 2^k with amax * 2^k <= the format's max). Scaling
  by them is exact, so an operand's FP8 value depends only on its own values, and the
  dequantisation `_scaled_mm` applies is exact too.
* The amax of an operand that is sharded over TP (every weight; the row-parallel input;
  the column-parallel output gradient) is all-reduced (max) over the TP group, as Transformer
  Engine reduces amaxes over TP. Every shard then uses the scale the whole tensor would get
  in one process, so FP8 is *layout-invariant*: TP2 (with or without sequence parallelism)
  computes what TP1 computes, up to summation order. Replicated operands need no reduction.

The weight gradient goes straight into the fp32 main grad when gradient-accumulation fusion
is on (see wgrad_fusion.py): written by the GEMM on a step's first accumulation, added
otherwise (`_scaled_mm` has no beta). The FP8 copies of x and W are what backward saves,
half the bytes of the bf16 ones.

GEMM shapes must be multiples of 16 (cuBLASLt's FP8 rule); job.validate_job refuses a
job whose tokens per microbatch, hidden or per-rank FFN / head sizes are not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronapp.parallel.eager_only import eager_only
from megatronapp.parallel.wgrad_defer import defer_or_run
from megatronapp.parallel.wgrad_fusion import consume_first_write

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_GRAD_DTYPE = {"e4m3": E4M3, "hybrid": E5M2}  # Megatron's --fp8-format -> the gradients' format
FP8_FORMATS = tuple(_GRAD_DTYPE)
FP8_RECIPES = ("tensorwise", "delayed")  # Megatron's --fp8-recipe; mxfp8 / blockwise are not built
AMAX_COMPUTE_ALGOS = ("most_recent", "max")  # Megatron's --fp8-amax-compute-algo
X, W, G = 0, 1, 2  # operand slots of a linear's delayed-scaling state: input, weight, output gradient
FP8_ALIGNMENT = 16  # every GEMM dimension, for cuBLASLt's FP8 kernels


@dataclass(frozen=True)
class FP8Spec:
    """How one linear casts its operands: the gradient format and, per operand, the TP group
    over which its amax is reduced (None: the operand is whole on every rank)."""

    grad_dtype: torch.dtype
    input_group: object = None
    weight_group: object = None
    grad_group: object = None


class DelayedScaling:
    """One linear's delayed-scaling state (per operand slot X, W, G): the scales this step
    casts with, the amaxes recorded this step (max over microbatches and recomputes), and the
    history they roll into. `ready` is False until a first step has filled the history."""

    def __init__(self, grad_dtype: torch.dtype, history_len: int, device):
        self.fmax = torch.tensor(
            [torch.finfo(E4M3).max, torch.finfo(E4M3).max, torch.finfo(grad_dtype).max], device=device
        )
        self.scale = torch.ones(3, device=device)
        self.amax_step = torch.zeros(3, device=device)
        self.history = torch.zeros(history_len, 3, device=device)
        self.ready = False


@eager_only  # communication stays outside compiled regions, as in parallel/mappings.py
def _all_reduce_max(amax: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def tensor_amax(t: torch.Tensor, group=None) -> torch.Tensor:
    """max |t| as an fp32 scalar tensor, over the whole TP-sharded tensor when `group` is given."""
    amax = t.detach().abs().amax().float()
    return amax if group is None else _all_reduce_max(amax, group)


def power_of_two_scale(amax: torch.Tensor, dtype_or_max: torch.dtype | torch.Tensor) -> torch.Tensor:
    """The largest 2^k with amax * 2^k <= the format's max (a dtype, or the max itself, per
    slot); an all-zero tensor gets 2^k with amax clamped to 1e-12; an inf/nan amax gives 0 or
    nan, so the GEMM's output shows it."""
    fmax = torch.finfo(dtype_or_max).max if isinstance(dtype_or_max, torch.dtype) else dtype_or_max
    return torch.exp2(torch.floor(torch.log2(fmax / amax.clamp(min=1e-12))))


def quantize(t: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t * scale cast to `dtype`, row-major, 1 / scale): `_scaled_mm` multiplies the product
    back by the reciprocals it is given, and takes its first operand row-major only (a
    gradient can arrive transposed; the cast keeps its strides)."""
    scale = power_of_two_scale(amax, dtype)
    return (t.float() * scale).to(dtype).contiguous(), scale.reciprocal()


def quantize_saturating(
    t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, fmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t * scale clamped to the format's range, cast, row-major; 1 / scale): the delayed cast,
    whose scale may be too large for a tensor that grew since (a plain cast would give NaN)."""
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).contiguous(), scale.reciprocal()


@torch.library.custom_op("megatronapp::fp8_record_amax", mutates_args=("amax_step",))
def _record_amax(amax_step: torch.Tensor, slot: int, amax: torch.Tensor) -> None:
    """amax_step[slot] = max(amax_step[slot], amax): an opaque in-place update, so that it may
    run in a compiled forward and in the backward (where graph mutations are not allowed)."""
    torch.maximum(amax_step[slot], amax, out=amax_step[slot])


@_record_amax.register_fake
def _(amax_step, slot, amax) -> None:
    return None


def _cast(t: torch.Tensor, dtype: torch.dtype, group, state: DelayedScaling | None, slot: int):
    """(FP8 t, 1 / scale): the recipe's cast of operand `slot`; with a delayed state, its amax
    is recorded (its first step casts with the current amax, which is exact to record)."""
    if state is not None and state.ready:
        q = quantize_saturating(t, dtype, state.scale[slot], state.fmax[slot])
        torch.ops.megatronapp.fp8_record_amax(state.amax_step, slot, t.detach().abs().amax().float())
        return q
    amax = tensor_amax(t, group)
    if state is not None:
        torch.ops.megatronapp.fp8_record_amax(state.amax_step, slot, amax)
    return quantize(t, dtype, amax)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major: `_scaled_mm`'s second operand must be."""
    return t.t().contiguous().t()


def _accumulate_fp8_weight_grad(
    main_grad: torch.Tensor,
    grad_t: torch.Tensor,
    input_cm: torch.Tensor,
    grad_inv_scale: torch.Tensor,
    input_inv_scale: torch.Tensor,
) -> None:
    """main_grad (out, in) fp32 (or bf16: --main-grads-dtype) (+)= dequant(grad_t) (out, T) @ dequant(input_cm) (T, in)."""
    out_dtype = main_grad.dtype
    if consume_first_write(main_grad):
        torch._scaled_mm(
            grad_t, input_cm, scale_a=grad_inv_scale, scale_b=input_inv_scale, out_dtype=out_dtype, out=main_grad
        )
    else:
        main_grad.add_(
            torch._scaled_mm(grad_t, input_cm, scale_a=grad_inv_scale, scale_b=input_inv_scale, out_dtype=out_dtype)
        )


@torch.library.custom_op("megatronapp::accumulate_fp8_weight_grad", mutates_args=("main_grad",))
def _accumulate_fp8_weight_grad_op(
    main_grad: torch.Tensor,
    grad_t: torch.Tensor,
    input_cm: torch.Tensor,
    grad_inv_scale: torch.Tensor,
    input_inv_scale: torch.Tensor,
) -> None:
    _accumulate_fp8_weight_grad(main_grad, grad_t, input_cm, grad_inv_scale, input_inv_scale)


@_accumulate_fp8_weight_grad_op.register_fake
def _(main_grad, grad_t, input_cm, grad_inv_scale, input_inv_scale) -> None:
    return None


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, main_grad, spec: FP8Spec, state: DelayedScaling | None, defer: bool):
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = _cast(x2, E4M3, spec.input_group, state, X)
        qw, sw = _cast(weight, E4M3, spec.weight_group, state, W)
        # fast accumulation in the forward only, as Transformer Engine and torchao do
        y = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.spec, ctx.state, ctx.main_grad, ctx.has_bias = spec, state, main_grad, bias is not None
        ctx.dtype, ctx.weight_dtype = x.dtype, weight.dtype
        ctx.weight = weight if defer else None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        qx, sx, qw, sw = ctx.saved_tensors
        spec = ctx.spec
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        qg, sg = _cast(g2, spec.grad_dtype, spec.grad_group, ctx.state, G)
        grad_x = torch._scaled_mm(qg, _column_major(qw), scale_a=sg, scale_b=sw, out_dtype=ctx.dtype)
        qg_t, qx_cm = qg.t().contiguous(), _column_major(qx)
        if ctx.weight is not None:  # split backward: the weight GEMM runs in W (wgrad_defer.py)
            defer_or_run(_DeferredFP8Gemm(ctx.weight, qg_t, qx_cm, sg, sx, ctx.main_grad is not None))
            grad_w = None
        elif ctx.main_grad is not None:
            torch.ops.megatronapp.accumulate_fp8_weight_grad(ctx.main_grad, qg_t, qx_cm, sg, sx)
            grad_w = torch.empty(qw.shape, dtype=ctx.weight_dtype, device=qw.device)  # dropped (wgrad_fusion)
        else:
            grad_w = torch._scaled_mm(qg_t, qx_cm, scale_a=sg, scale_b=sx, out_dtype=ctx.weight_dtype)
        grad_bias = g2.sum(0) if ctx.has_bias else None
        return grad_x.view(*grad_out.shape[:-1], grad_x.shape[-1]), grad_w, grad_bias, None, None, None, None


class _DeferredFP8Gemm:
    """An FP8 linear's weight-gradient GEMM, run in W (split backward, wgrad_defer.py)."""

    def __init__(self, weight, grad_t, input_cm, grad_inv_scale, input_inv_scale, fused: bool):
        self.weight, self.fused = weight, fused
        self.operands = (grad_t, input_cm, grad_inv_scale, input_inv_scale)

    def run(self) -> None:
        main = self.weight.main_grad
        if self.fused:
            _accumulate_fp8_weight_grad(main, *self.operands)
        else:  # the low-precision weight gradient, then the widening add its hook would do
            grad_t, input_cm, sg, sx = self.operands
            main.add_(torch._scaled_mm(grad_t, input_cm, scale_a=sg, scale_b=sx, out_dtype=self.weight.dtype))


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spec: FP8Spec,
    *,
    main_grad: torch.Tensor | None = None,
    state: DelayedScaling | None = None,
    defer_weight_grad: bool = False,
) -> torch.Tensor:
    """F.linear(x, weight, bias) with FP8 GEMMs; with `main_grad` the weight gradient is
    accumulated there (fp32) and autograd gets a placeholder, as wgrad_fusion does; with
    `state`, the delayed recipe's scales (else current scaling); with `defer_weight_grad` the
    weight GEMM runs in W (split backward, wgrad_defer.py)."""
    return _FP8Linear.apply(x, weight, bias, main_grad, spec, state, defer_weight_grad)


def enable_fp8(blocks, fmt: str, recipe: str = "tensorwise", history_len: int = 1) -> int:
    """Switch every TP linear inside `blocks` (the transformer layers; not the embedding or
    the output layer) to FP8 GEMMs in format `fmt` and `recipe` (checked by
    config.TrainConfig), a DelayedScaling state each for `delayed`; returns how many were switched."""
    grad_dtype = _GRAD_DTYPE[fmt]
    count = 0
    for block in blocks:
        for m in block.modules():
            if hasattr(m, "fp8_spec"):
                m.fp8_spec = m.fp8_spec_for(grad_dtype)
                if recipe == "delayed":
                    m.fp8_state = DelayedScaling(grad_dtype, history_len, m.weight.device)
                count += 1
    return count


def delayed_states(modules) -> dict[str, DelayedScaling]:
    """name -> state of every delayed-scaling linear among named `modules` ((name, module) pairs)."""
    return {name: m.fp8_state for name, m in modules if getattr(m, "fp8_state", None) is not None}


def compute_delayed_scales(
    history: torch.Tensor, old: torch.Tensor, fmax: torch.Tensor, algo: str, margin: int
) -> torch.Tensor:
    """New per-slot scales from an amax history (steps x slots): power-of-two scales under
    fmax / 2^margin; a slot whose amax is not finite or not positive keeps its old scale."""
    amax = history[0] if algo == "most_recent" else history.max(dim=0).values
    scale = power_of_two_scale(amax, fmax) / 2.0**margin
    return torch.where(torch.isfinite(amax) & (amax > 0), scale, old)


@torch.no_grad()
def update_delayed_scaling(states, groups, algo: str, margin: int) -> None:
    """End of a step, collective over TP and DP (every rank of a stage holds the same linears,
    in the same order): max-reduce the step's recorded amaxes, roll them into each history,
    and set the scales the next step casts with. All linears at once, stacked, as Transformer
    Engine keeps one global amax buffer: a dozen kernels for the model, where a loop over the
    linears launched a dozen per linear (1,150 a step for the 1.4B model's 96)."""
    states = list(states)
    if not states:
        return
    amaxes = torch.stack([st.amax_step for st in states])  # (linears, slots)
    for group in (groups.tp, groups.dp):
        if group is not None:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    history = torch.stack([st.history for st in states], dim=1)  # (steps, linears, slots), newest first
    history = torch.cat([amaxes.unsqueeze(0), history[:-1]])
    old = torch.stack([st.scale for st in states])
    scales = compute_delayed_scales(history, old, torch.stack([st.fmax for st in states]), algo, margin)
    torch._foreach_copy_([st.history for st in states], list(history.unbind(1)))
    torch._foreach_copy_([st.scale for st in states], list(scales.unbind(0)))
    torch._foreach_zero_([st.amax_step for st in states])
    for st in states:
        st.ready = True


def delayed_state_dict(states: dict[str, DelayedScaling]) -> dict:
    """What a checkpoint keeps (equal on every TP and DP rank after the step's reduction)."""
    return {
        name: {"history": st.history.cpu(), "scale": st.scale.cpu(), "ready": st.ready} for name, st in states.items()
    }


def load_delayed_state_dict(states: dict[str, DelayedScaling], saved: dict) -> None:
    """Restore what delayed_state_dict kept; a linear the checkpoint lacks (saved under
    tensorwise, or before delayed scaling existed), or whose history has another length,
    starts afresh, with current scaling for a step."""
    for name, st in states.items():
        entry = saved.get(name)
        if entry is None or entry["history"].shape != st.history.shape:
            continue
        st.history.copy_(entry["history"])
        st.scale.copy_(entry["scale"])
        st.ready = bool(entry["ready"])
