"""Megatron mixed precision: low-precision params, fp32 main grads, fp32 master weights.

With --bf16/--fp16 the model's parameters and activations are bf16/fp16 (no autocast),
gradients accumulate in the fp32 `main_grad` buffers of engine.grads and are reduced over
DP in fp32, and AdamW updates fp32 master copies ("main params") that are copied back to
the model after each step. In fp32 the model parameters are their own main params. With
the distributed optimizer each DP rank keeps main params and Adam state only for its
shards (engine.distrib_optimizer) and all-gathers the updated parameters.

One optimizer step, as Megatron's MixedPrecisionOptimizer.step:
  1. with a loss scaler: unscale main grads, find inf/nan (max over DP and model-parallel
     ranks); on overflow skip the step and let the scaler lower the scale;
  2. global grad norm (each element counted once) and clipping;
  3. AdamW on the main params;
  4. main params -> model params (and all-gather of the shards).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatronapp.config import ConfigError, JobConfig, OptimizerConfig, PrecisionConfig
from megatronapp.engine import master_adam
from megatronapp.engine.distrib_optimizer import gather_full_params
from megatronapp.engine.grad_scaler import build_grad_scaler
from megatronapp.engine.grads import GradReducer, clip_coefficient, clip_grads, compute_grad_norms
from megatronapp.engine.main_params import MainParam, build_main_params, compute_state_precision
from megatronapp.engine.optim import build_adamw
from megatronapp.engine.overlap_update import OverlappedUpdate
from megatronapp.engine.precision_adam import STATE_DTYPES, build_precision_adamw
from megatronapp.parallel.wgrad_fusion import enable_grad_accumulation_fusion

log = logging.getLogger("megatronapp.engine")


def params_dtype(cfg: PrecisionConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32


@dataclass(frozen=True)
class PreparedStep:
    """A step's checks before its update (MixedPrecisionOptimizer.prepare_step)."""

    grad_norm: torch.Tensor | None  # None: the loss scaler found inf/nan (the step is skipped, known on the host)
    loss_scale: float | None
    skip: torch.Tensor | None = None  # the non-finite check's device flag (see StepResult)
    first_nonfinite: torch.Tensor | None = None


@dataclass(frozen=True)
class StepResult:
    update_successful: bool  # False: skipped by the loss scaler's inf check (known on the host)
    grad_norm: torch.Tensor | None  # None when the step was skipped
    loss_scale: float | None
    # with the non-finite check: 1.0 where the update was skipped on the device (a 0-dim fp32
    # tensor, read at the log interval), and the index in `norm_params` of this rank's first
    # non-finite grad (len(norm_params) when none)
    skipped_nonfinite: torch.Tensor | None = None
    first_nonfinite: torch.Tensor | None = None


class MixedPrecisionOptimizer:
    """AdamW over fp32 main params, with loss scaling, clipping and (optionally) DP sharding."""

    def __init__(
        self,
        reducer: GradReducer,
        cfg: OptimizerConfig,
        precision: PrecisionConfig,
        groups,
        device: torch.device,
        *,
        log_overflow: bool = True,
        fused: bool | None = None,
    ):
        self.reducer, self.cfg, self.precision, self.groups, self.device = reducer, cfg, precision, groups, device
        self.store = compute_state_precision(cfg, precision)  # None: the plain fp32-state optimizer
        self.chunk_mains = build_main_params(reducer, groups.tp_rank, self.store)
        self.mains = [m for chunk in self.chunk_mains for m in chunk]
        self.norm_params = [m.model_param for m in self.mains if m.count_in_norm]  # the norm's terms, in order
        # fused (one CUDA kernel; default on GPU) also takes the clip factor as its grad_scale
        self.fused = device.type == "cuda" if fused is None else fused
        decays = [(m.main_param, m.model_param.ndim >= 2) for m in self.mains]
        if self.store is None:
            self.optimizer = build_adamw(decays, cfg, fused=self.fused)
        else:
            self.optimizer = build_precision_adamw(
                decays, cfg, self.store, {id(m.main_param): m.main_grad for m in self.mains}
            )
        # bf16/fp16 on CUDA: AdamW + clip + master->model copy in one kernel (engine/master_adam.py)
        self.master_kernel = cfg.fused_master_adamw and self._has_separate_mains() and master_adam.available(device)
        self._model_view_of = {id(m.main_param): self._model_view(m) for m in self.mains}
        self._master_adamw = None
        # the precision-aware optimizer's grads are not its mains' .grad
        self._kernel_kw = (
            {} if self.store is None else {"grad_of": self.optimizer.grad_of, "remainders": self._remainders}
        )
        if self.master_kernel:
            self._master_adamw = master_adam.MasterAdamW(self.optimizer, self._model_view_of, **self._kernel_kw)
        if cfg.overlap_param_update and not self.master_kernel:
            raise ConfigError("--overlap-param-update needs the fused master AdamW: CUDA, Triton, --bf16/--fp16")
        self.overlapped_update: OverlappedUpdate | None = None  # see enable_overlapped_update
        self.grad_scaler = build_grad_scaler(precision, device)
        self.skipped_iterations = 0
        self.log_overflow = log_overflow
        # the groups a per-rank sum must cover to count every element once
        self._norm_groups = [groups.model_parallel] + ([groups.dp] if reducer.distributed else [])

    def enable_overlapped_update(self, chunks: list[nn.Module]) -> None:
        """From the next step on, the update runs unit by unit beside the next forward
        (engine/overlap_update.py); its per-unit kernels replace the one-launch kernel."""
        self.overlapped_update = OverlappedUpdate(
            self.optimizer, self._model_view_of, chunks, self.chunk_mains, self.device, self._kernel_kw
        )
        self._master_adamw = None

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for model state, by kind (Adam's after the first step)."""
        states = list(self.optimizer.state.values())
        adam = sum(st[k].numel() * st[k].element_size() for st in states for k in ("exp_avg", "exp_avg_sq") if k in st)
        remainders = sum(st["param_remainder"].numel() * 2 for st in states if "param_remainder" in st)
        params = [p for buf in self.reducer.buffers for p in buf.params]
        separate = [m.main_param for m in self.mains if m.model_param.dtype != torch.float32 and not self._remainders]
        return {
            "params": sum(p.numel() * p.element_size() for p in params),
            "main_grads": sum(buf.grad_data.numel() * buf.grad_data.element_size() for buf in self.reducer.buffers),
            "main_params": sum(t.numel() * t.element_size() for t in separate) + remainders,
            "adam": adam,
        }

    @property
    def _remainders(self) -> bool:
        """Whether the masters are stored as the bf16 model weights + remainders (no separate mains)."""
        return self.store is not None and self.store.param_remainders

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Megatron's grad_scale_func: applied to the loss right before backward."""
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale.view(()).to(loss.dtype)

    def main_grads(self) -> list[torch.Tensor]:
        return [m.main_grad for m in self.mains]

    @torch.no_grad()
    def step(self, check_nonfinite: bool = False, loss_nonfinite: torch.Tensor | None = None) -> StepResult:
        """Steps 1-4 above; call after the DP reduction of the grads has finished.

        check_nonfinite: a non-finite grad norm or `loss_nonfinite` (a 0-dim fp32 device flag of
        this rank) on any rank skips the update on every rank (one small all-reduce), on the
        device, with no host sync:
        the fused kernels take the flag as their found_inf (torch's AdamW rolls its step
        counters back, the master kernel masks its writes). Only the unfused path (the CPU's)
        reads the flag on the host."""
        return self.apply_step(self.prepare_step(check_nonfinite, loss_nonfinite))

    @torch.no_grad()
    def prepare_step(self, check_nonfinite: bool = False, loss_nonfinite: torch.Tensor | None = None) -> PreparedStep:
        """Steps 1-2 (and the non-finite check) of `step`, before anything is updated: what a
        check before the update reads (engine/rerun.py). The loss scaler has taken the step."""
        scale = None if self.grad_scaler is None else float(self.grad_scaler.scale)
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check_for_nan()
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.skipped_iterations += 1
                if self.log_overflow:
                    log.warning(
                        "found inf/nan in gradients: skipped the step, loss scale %g -> %g",
                        scale,
                        float(self.grad_scaler.scale),
                    )
                return PreparedStep(None, scale)
        norm, per_tensor = compute_grad_norms(
            [m.main_grad for m in self.mains if m.count_in_norm], self._norm_groups, self.device
        )
        skip = first_bad = None
        if check_nonfinite:
            skip, first_bad = _nonfinite_flags(norm, per_tensor, loss_nonfinite)
            if self.groups.world is not None:  # every rank skips together (and names it together)
                dist.all_reduce(skip, op=dist.ReduceOp.MAX, group=self.groups.world)
        return PreparedStep(norm, scale, skip, first_bad)

    @torch.no_grad()
    def apply_step(self, prepared: PreparedStep, hold: torch.Tensor | None = None) -> StepResult:
        """Steps 3-4 of `step` after `prepare_step`. `hold`: a device flag (0/1, the same on every
        rank) that also skips the update; it is not counted as a non-finite skip."""
        if prepared.grad_norm is None:
            return StepResult(False, None, prepared.loss_scale)
        skip = prepared.skip
        if hold is not None:
            skip = hold if skip is None else torch.maximum(skip, hold)
        self._apply_update(prepared.grad_norm, skip)
        # overlapped: each chunk waits in its next forward (pre-hook of build_grads_and_optimizer)
        self.reducer.start_param_gather(wait=not self.cfg.overlap_param_gather)
        return StepResult(True, prepared.grad_norm, prepared.loss_scale, prepared.skip, prepared.first_nonfinite)

    def _apply_update(self, norm: torch.Tensor, skip: torch.Tensor | None) -> None:
        """Clip + AdamW + main->model copy, by the fastest path built; `skip` (device 0/1) or None."""
        if self.overlapped_update is not None:  # runs beside the next forward
            self.overlapped_update.launch(self._clip_divisor(norm), self.reducer.zero_buffer, skip=skip)
        elif self.master_kernel:
            self._master_adamw.step(self._clip_divisor(norm), skip=skip)
        elif self.store is not None and self.device.type != "cpu":  # precision-aware, flag kept on the device
            self.optimizer.step(self._clip_divisor(norm), skip)
            self._copy_main_to_model_params()
        elif self.fused:
            self.optimizer.grad_scale = self._clip_divisor(norm)
            self.optimizer.found_inf = skip  # torch's fused AdamW: no update, step counters unchanged
            self.optimizer.step()
            self._copy_main_to_model_params()
        elif skip is None or not bool(skip):  # unfused (CPU): the host decides
            clip_grads(self.main_grads(), norm, self.cfg.clip_grad)
            self.optimizer.step()
            self._copy_main_to_model_params()

    def _clip_divisor(self, norm: torch.Tensor) -> torch.Tensor | None:
        """1 / clip factor, for kernels that divide each grad by it on the way (fused AdamW's
        `grad_scale`, the master kernel): no read-modify-write pass of clip_grads over the grads."""
        return clip_coefficient(norm, self.cfg.clip_grad).reciprocal() if self.cfg.clip_grad > 0 else None

    def _unscale_and_check_for_nan(self) -> bool:
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        grads = self.main_grads()
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self.grad_scaler.inv_scale)
        for group in (self.groups.dp, self.groups.model_parallel):
            if group is not None:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return bool(found_inf.item() > 0)

    def _copy_main_to_model_params(self) -> None:
        if self._remainders:  # the update wrote the model weights themselves
            return
        pairs = [(self._model_view(m), m.main_param) for m in self.mains if m.model_param.dtype != torch.float32]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])

    @staticmethod
    def _model_view(m: MainParam) -> torch.Tensor:
        p = m.model_param.detach()
        return p if m.shard is None else p.view(-1)[m.shard.start : m.shard.end]

    # -- checkpoints: layout-independent state per model parameter --------------------------
    def finish_param_sync(self) -> None:
        """Wait for in-flight parameter updates and all-gathers; call before reading or writing
        params or optimizer state."""
        if self.overlapped_update is not None:
            self.overlapped_update.wait_all()
        self.reducer.wait_param_gather()

    def state_dict(self) -> dict:
        scaler = None if self.grad_scaler is None else self.grad_scaler.state_dict()
        return {"grad_scaler": scaler, "skipped_iterations": self.skipped_iterations}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_iterations = int(state.get("skipped_iterations", 0))
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])

    def param_state(self) -> dict[nn.Parameter, dict]:
        """Collective over DP with the distributed optimizer. Per model parameter (its TP
        shard, full along DP): exp_avg, exp_avg_sq, step and, when it differs from the
        model param, the fp32 main param. Parameters never stepped are absent."""
        self.finish_param_sync()
        keys = ("exp_avg", "exp_avg_sq") + (("main_param",) if self._has_separate_mains() else ())
        step = self._step_count()
        if step is None:
            return {}
        out: dict[nn.Parameter, dict] = {}
        for mains, buf in zip(self.chunk_mains, self.reducer.buffers):
            index = {p: i for i, p in enumerate(buf.params)}
            for key in keys:
                values = self._full_values(mains, buf, index, key)
                for p, v in zip(buf.params, values):
                    out.setdefault(p, {"step": step})[key] = v
        return out

    def main_grads_by_param(self) -> dict[nn.Parameter, torch.Tensor]:
        """Collective over DP with the distributed optimizer: each parameter's DP-reduced
        (and clipped, after step) fp32 main grad, whole along DP (for tests and inspection)."""
        out = {}
        for mains, buf in zip(self.chunk_mains, self.reducer.buffers):
            index = {p: i for i, p in enumerate(buf.params)}
            out.update(zip(buf.params, self._full_values(mains, buf, index, "main_grad")))
        return out

    def _has_separate_mains(self) -> bool:
        # fp32 models hold the main params' values themselves (also when sharded)
        return params_dtype(self.precision) != torch.float32

    def _step_count(self) -> float | None:
        steps = [float(st["step"]) for st in self.optimizer.state.values() if "step" in st]
        local = torch.tensor([max(steps, default=-1.0)], device=self.device)
        if self.reducer.distributed and self.groups.dp is not None:  # a rank may own no shard at all
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.groups.dp)
        return None if local.item() < 0 else float(local.item())

    def _value(self, m: MainParam, key: str) -> torch.Tensor:
        """fp32 values whatever the storage (checkpoints are layout- and precision-independent)."""
        if key == "main_grad":
            return m.main_grad
        if key == "main_param":
            return m.main_param if self.store is None else self.optimizer.master_value(m.main_param)
        return self.optimizer.state[m.main_param][key].float()

    def _full_values(self, mains, buf, index, key) -> list[torch.Tensor]:
        if not self.reducer.distributed:
            return [self._value(m, key) for m in mains]
        shards = {index[m.model_param]: (m.shard, self._value(m, key)) for m in mains}
        return gather_full_params(buf, shards, self.groups.dp, self.reducer.dp_size, self.reducer.dp_rank)

    @torch.no_grad()
    def load_param_state(self, state_of) -> None:
        """`state_of(model_param)` -> the dict of param_state() (TP-local, full along DP) or
        None; the model params themselves must already hold the checkpoint's values."""
        if self._master_adamw is not None:  # its address tables name the Adam state replaced below
            self._master_adamw.invalidate()
        if self.overlapped_update is not None:
            self.overlapped_update.invalidate()
        for m in self.mains:
            st = state_of(m.model_param)
            if st is not None:
                self.optimizer.state[m.main_param] = self._stored_state(m, st)
            if m.model_param.dtype != torch.float32:
                source = st["main_param"] if (st and "main_param" in st) else m.model_param.detach()
                if self.store is None:
                    m.main_param.copy_(self._slice(m, source))
                else:  # also creates the state a remainder needs
                    self.optimizer.load_master(m.main_param, self._slice(m, source))

    def _stored_state(self, m: MainParam, st: dict) -> dict:
        """A param's Adam state from its checkpoint values, in the dtypes this optimizer stores."""
        exp_avg_dtype = torch.float32 if self.store is None else self.store.exp_avg
        exp_avg_sq_dtype = torch.float32 if self.store is None else self.store.exp_avg_sq
        return {
            "exp_avg": self._slice(m, st["exp_avg"]).to(exp_avg_dtype, copy=True),
            "exp_avg_sq": self._slice(m, st["exp_avg_sq"]).to(exp_avg_sq_dtype, copy=True),
            "step": torch.tensor(
                float(st["step"]), dtype=torch.float32, device=self.device if self.device.type == "cuda" else "cpu"
            ),
        }

    def _slice(self, m: MainParam, full: torch.Tensor) -> torch.Tensor:
        full = full.to(device=self.device, dtype=torch.float32).reshape(m.model_param.shape)
        return full if m.shard is None else full.reshape(-1)[m.shard.start : m.shard.end]


def _nonfinite_flags(
    norm: torch.Tensor, per_tensor: torch.Tensor, loss_nonfinite: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(skip flag, index of this rank's first non-finite per-tensor norm or len(per_tensor)), on the device."""
    skip = (~torch.isfinite(norm)).float()
    if loss_nonfinite is not None:
        skip = torch.maximum(skip, loss_nonfinite)
    index = torch.arange(per_tensor.numel(), device=per_tensor.device)
    first_bad = (
        torch.where(torch.isfinite(per_tensor), per_tensor.numel(), index).min()
        if per_tensor.numel()
        else torch.zeros((), dtype=torch.int64, device=per_tensor.device)
    )
    return skip, first_bad


def build_grads_and_optimizer(
    chunks: list[nn.Module], job: JobConfig, groups, device: torch.device
) -> tuple[GradReducer, MixedPrecisionOptimizer]:
    """Cast the model to its params dtype, build its main-grad buffers and the optimizer."""
    t, opt, prec = job.train, job.optimizer, job.precision
    dtype = params_dtype(prec)
    if dtype != torch.float32:
        for c in chunks:
            c.to(dtype)
    lay = groups.layout
    reducer = GradReducer(
        chunks,
        groups.dp,
        lay.dp_size,
        dp_rank=groups.dp_rank,
        overlap=t.overlap_grad_reduce,
        bucket_mb=t.grad_bucket_mb,
        distributed_optimizer=opt.use_distributed_optimizer,
        grad_dtype=STATE_DTYPES[opt.main_grads_dtype],
        embedding_group=groups.embedding,
    )
    if opt.overlap_param_gather:
        for i, c in enumerate(chunks):  # a chunk's first forward waits for its params' all-gather
            c.register_forward_pre_hook(lambda *_, i=i: reducer.wait_param_gather(i))
    if prec.gradient_accumulation_fusion:  # needs the main grads, so after the reducer
        enable_grad_accumulation_fusion(m for c in chunks for m in c.modules())
    optimizer = MixedPrecisionOptimizer(reducer, opt, prec, groups, device, log_overflow=groups.rank == 0)
    if opt.overlap_param_update:
        optimizer.enable_overlapped_update(chunks)
    return reducer, optimizer
