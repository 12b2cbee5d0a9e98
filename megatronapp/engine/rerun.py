"""Rerun of a flagged step (Megatron's --rerun-mode): restore the state from before the step,
execute it again, and classify it from the two executions.

validate_results: every step is judged on the host right after it (engine/integrity.py); a
  flagged one (non-finite, spiky loss, large grads) is restored and executed again. The same
  loss and grad norm on every rank, bit for bit, means the inputs decide the outcome:
  "reproducible" (with skip_spiky_batches the batch is then consumed without an update).
  Any difference means something else decided it (a race, a flaky device): "transient";
  the second execution's result is kept and training continues.
report_stats: every rerun_stats_interval-th step is executed twice and the run-to-run
  differences reported.

Cost: judging a step before the next one starts needs its loss and grad norm on the host,
so these modes synchronise once a step (plus one small all-reduce), and the pre-step
snapshot (in device memory) copies the model params, the fp32 master params and Adam's two
moments every step: about 4 + 12 bytes a parameter of memory traffic, and as much memory.
With --rerun-mode disabled nothing here runs.
"""

from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatronapp.config import IntegrityConfig
from megatronapp.engine.integrity import StepHistory, compute_differing_ranks, compute_rerun_verdict, compute_step_flags


@dataclass
class StepSnapshot:
    """Everything a step changes, as it was before the step (device copies, no host transfer
    of tensors)."""

    iteration: int
    params: list[torch.Tensor]
    mains: list[torch.Tensor | None]  # separate fp32 master params, else None
    adam: dict[int, dict]  # id(main param) -> Adam state clone
    optimizer: dict  # loss scaler and skip count
    fp8: dict
    rng: dict
    data: dict


def _all_params(trainer) -> list[torch.Tensor]:
    return [p for c in trainer.chunks for p in c.parameters()]


@torch.no_grad()
def capture_state(trainer) -> StepSnapshot:
    opt = trainer.optimizer
    opt.finish_param_sync()
    separate = [
        m.main_param if m.main_param is not m.model_param and m.model_param.dtype != torch.float32 else None
        for m in opt.mains
    ]
    adam = {
        id(m.main_param): {
            k: v.clone() if torch.is_tensor(v) else v for k, v in opt.optimizer.state.get(m.main_param, {}).items()
        }
        for m in opt.mains
    }
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "tracker": trainer.rng_tracker.get_states(),
        "cuda": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None,
    }
    fp8 = {name: (st.history.clone(), st.scale.clone(), st.ready) for name, st in trainer.fp8_states.items()}
    return StepSnapshot(
        trainer.iteration,
        [p.detach().clone() for p in _all_params(trainer)],
        [None if s is None else s.detach().clone() for s in separate],
        adam,
        copy.deepcopy(opt.state_dict()),
        fp8,
        rng,
        copy.deepcopy(trainer.data.state_dict()),
    )


@torch.no_grad()
def restore_state(trainer, snap: StepSnapshot) -> None:
    """Copy `snap` back in place (the fused kernels' address tables stay valid)."""
    opt = trainer.optimizer
    opt.finish_param_sync()
    for p, saved in zip(_all_params(trainer), snap.params):
        p.copy_(saved)
    replaced = False
    for m, main in zip(opt.mains, snap.mains):
        if main is not None:
            m.main_param.copy_(main)
        saved, state = snap.adam[id(m.main_param)], opt.optimizer.state.get(m.main_param)
        if state is not None and set(saved) == set(state):
            for k, v in saved.items():
                if torch.is_tensor(v):
                    state[k].copy_(v)
                else:
                    state[k] = v
        else:  # state created by the step (the first one): back to what was there
            opt.optimizer.state[m.main_param] = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved.items()}
            replaced = True
    if replaced:
        for kernel in (opt._master_adamw, opt.overlapped_update):
            if kernel is not None:
                kernel.invalidate()
    opt.load_state_dict(copy.deepcopy(snap.optimizer))
    for name, (history, scale, ready) in snap.fp8.items():
        st = trainer.fp8_states[name]
        st.history.copy_(history)
        st.scale.copy_(scale)
        st.ready = ready
    torch.set_rng_state(snap.rng["torch"])
    random.setstate(snap.rng["python"])
    trainer.rng_tracker.set_states(snap.rng["tracker"])
    if snap.rng["cuda"] is not None:
        torch.cuda.set_rng_state(snap.rng["cuda"], trainer.device)
    trainer.data.load_state_dict(copy.deepcopy(snap.data))
    trainer.iteration = snap.iteration


def gather_step_values(trainer, pending) -> list[tuple[float, float]]:
    """Every rank's (loss share, grad norm) of a step, on every rank: one copy and one all-reduce."""
    world, rank = trainer.job.layout.world_size, trainer.groups.rank
    slots = torch.zeros(world, 2, device=trainer.device)
    if pending.loss is not None:
        slots[rank, 0] = pending.loss
    slots[rank, 1] = pending.grad_norm.float()
    if world > 1:
        dist.all_reduce(slots, group=trainer.groups.world)
    return [tuple(row) for row in slots.cpu().tolist()]


def compute_global_values(per_rank: list[tuple[float, float]], dp_size: int) -> tuple[float, float]:
    """(mean loss, grad norm) of a step from its per-rank values (the norm is the largest
    any rank saw: they agree unless something went wrong on one, which is what is looked for)."""
    norms = [n for _, n in per_rank]
    norm = float("nan") if any(n != n for n in norms) else max(norms)
    return sum(loss for loss, _ in per_rank) / dp_size, norm


class StepValidator:
    """Runs steps under --rerun-mode validate_results or report_stats (see the module docstring)."""

    def __init__(self, cfg: IntegrityConfig):
        self.cfg, self.history = cfg, StepHistory.build(cfg.check_window)

    def run_step(self, trainer):
        """One step under the rerun mode; returns its pending metrics with `flags` (and `rerun`) set."""
        it = trainer.iteration
        validate = self.cfg.rerun_mode == "validate_results"
        sampled = not validate and (it + 1) % self.cfg.rerun_stats_interval == 0
        snap = capture_state(trainer) if (validate or sampled) else None
        first = trainer._execute_step(attempt=0)
        values = gather_step_values(trainer, first)
        loss, norm = compute_global_values(values, trainer.job.layout.dp_size)
        flags = compute_step_flags(loss, norm, self.history.losses, self.history.norms, self.cfg)
        if not flags:
            self.history.accept(loss, norm)
        if sampled:
            return self._report_stats(trainer, snap, values, flags)
        if not (validate and flags):
            return replace(first, flags=flags)
        return self._validate(trainer, snap, values, flags)

    def _report_stats(self, trainer, snap: StepSnapshot, values, flags):
        restore_state(trainer, snap)
        second = trainer._execute_step(attempt=1)
        again = gather_step_values(trainer, second)
        (loss, norm), (loss2, norm2) = (compute_global_values(v, trainer.job.layout.dp_size) for v in (values, again))
        report = {
            "mode": "report_stats",
            "ranks": compute_differing_ranks(values, again),
            "loss_delta": abs(loss2 - loss),
            "grad_norm_delta": abs(norm2 - norm),
        }
        return replace(second, flags=flags, rerun=report)

    def _validate(self, trainer, snap: StepSnapshot, values, flags):
        observer = trainer.replay_observer  # e.g. MegaScope's training view (see Trainer)
        if observer is not None:
            observer.flagged(snap.iteration, flags)  # the flagged execution's grads are still in place
        restore_state(trainer, snap)
        with observer.replaying(snap.iteration) if observer is not None else contextlib.nullcontext():
            second = trainer._execute_step(attempt=1)
        again = gather_step_values(trainer, second)
        ranks = compute_differing_ranks(values, again)
        verdict = compute_rerun_verdict(ranks)
        report = {"flag": list(flags), "verdict": verdict, "ranks": ranks}
        trainer.tracer.mark_iteration(snap.iteration, "rerun", verdict=verdict, flag=",".join(flags))
        if observer is not None:
            observer.classified(snap.iteration, report)
        loss, norm = compute_global_values(again, trainer.job.layout.dp_size)
        if verdict == "transient" and not compute_step_flags(
            loss, norm, self.history.losses, self.history.norms, self.cfg
        ):
            self.history.accept(loss, norm)
        if verdict == "reproducible" and self.cfg.skip_spiky_batches:
            consumed = copy.deepcopy(trainer.data.state_dict())
            restore_state(trainer, snap)
            trainer.data.load_state_dict(consumed)
            trainer.iteration += 1
            trainer.optimizer.skipped_iterations += 1
            report["skipped"] = True
            return replace(
                second,
                iteration=trainer.iteration,
                skipped_nonfinite=None,
                flags=flags,
                rerun=report,
                skipped_iterations=trainer.optimizer.skipped_iterations,
            )
        return replace(second, flags=flags, rerun=report)
