"""Rerun of a flagged step (Megatron's --rerun-mode), checked before the optimizer step.

validate_results: each step's loss and grad norm are checked before its update, on the device:
  every rank's pair is summed into one small tensor by an all-reduce, and the flags (non-finite,
  spiky loss, large grads: engine/integrity.py's rules, the recent accepted steps kept on the
  device as well) are computed from it. A flagged step's update is skipped on the device,
  and so is every later update until the log interval (a "hold": the weights stay those the
  flagged step started from). Nothing is read on the host between log intervals. At the
  interval, a flagged step is executed again from the same weights: only what the step consumed
  besides them is put back (its data position, the RNG streams, the FP8 scaling state and the
  loss scaler: a ReplayPoint, kilobytes plus the delayed-FP8 amax histories, whatever the
  model size), and the held steps after
  it are dropped and executed again as the next steps.
  Verdict: the same loss and grad norm on every rank, bit for bit, means the inputs decide the
  outcome: "reproducible" (with skip_spiky_batches the batch is then consumed without an update).
  A difference in a --deterministic run means something else decided it: "transient". Without
  --deterministic the kernels may differ from run to run, so the step is executed once more and
  the difference is compared with the spread between those two executions (the run-to-run spread
  report_stats measures): within it, "reproducible"; beyond it, "transient". The last execution's
  update is applied (unless skipped).
report_stats: every rerun_stats_interval-th step is executed twice before its update and the
  differences reported at the log interval (the second execution's update is applied).

Cost when nothing is flagged (validate_results): per step one all-reduce of 2 x world floats,
a ReplayPoint on the host and copies of the FP8 scaling histories on the device; no copy of
params or optimizer state, no host sync. A flagged step costs its reruns and the held steps
after it. With --rerun-mode disabled nothing here runs.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatronapp.config import IntegrityConfig
from megatronapp.engine.integrity import (
    MAD_TO_STD,
    RELATIVE_FLOOR,
    StepHistory,
    compute_differing_ranks,
    compute_rerun_verdict,
    compute_step_flags,
)

# a step's flags on the device, one bit each
FLAG_BITS = (("nan", 1), ("spiky_loss", 2), ("large_grads", 4))


@dataclass
class ReplayPoint:
    """What one step consumes besides the weights and the optimizer state, as it was before
    the step: enough to execute the step again from the same weights."""

    iteration: int
    data: dict
    rng: dict
    fp8: dict  # name -> (amax history, scale, ready): per linear, not per parameter element
    optimizer: dict  # loss scaler and skip count


@dataclass(frozen=True)
class StepCheck:
    """The rerun mode's record of one executed step."""

    replay: ReplayPoint
    values: torch.Tensor  # (world, 2) on the device: every rank's loss share and grad norm
    code: torch.Tensor | None = None  # validate_results: the flags' bits (0: fine)
    rerun_values: torch.Tensor | None = None  # report_stats: the second execution's values


def capture_replay_point(trainer) -> ReplayPoint:
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "tracker": trainer.rng_tracker.get_states(),
        "cuda": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None,
    }
    fp8 = {name: (st.history.clone(), st.scale.clone(), st.ready) for name, st in trainer.fp8_states.items()}
    return ReplayPoint(
        trainer.iteration,
        copy.deepcopy(trainer.data.state_dict()),
        rng,
        fp8,
        copy.deepcopy(trainer.optimizer.state_dict()),
    )


@torch.no_grad()
def restore_replay_point(trainer, point: ReplayPoint) -> None:
    """Put `point` back; the weights and optimizer state are left as they are."""
    trainer.optimizer.load_state_dict(copy.deepcopy(point.optimizer))
    for name, (history, scale, ready) in point.fp8.items():
        st = trainer.fp8_states[name]
        st.history.copy_(history)
        st.scale.copy_(scale)
        st.ready = ready
    torch.set_rng_state(point.rng["torch"])
    random.setstate(point.rng["python"])
    trainer.rng_tracker.set_states(point.rng["tracker"])
    if point.rng["cuda"] is not None:
        torch.cuda.set_rng_state(point.rng["cuda"], trainer.device)
    trainer.data.load_state_dict(copy.deepcopy(point.data))
    trainer.iteration = point.iteration


def gather_step_values(trainer, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> torch.Tensor:
    """(world, 2) on the device, the same on every rank: each rank's loss share and grad norm (one all-reduce)."""
    world, rank = trainer.job.layout.world_size, trainer.groups.rank
    slots = torch.zeros(world, 2, device=trainer.device)
    if loss is not None:
        slots[rank, 0] = loss
    slots[rank, 1] = grad_norm.float()
    if world > 1:
        dist.all_reduce(slots, group=trainer.groups.world)
    return slots


def compute_global_values(per_rank: list[tuple[float, float]], dp_size: int) -> tuple[float, float]:
    """(mean loss, grad norm) of a step from its per-rank values (the norm is the largest
    any rank saw: they agree unless something went wrong on one, which is what is looked for)."""
    norms = [n for _, n in per_rank]
    norm = float("nan") if any(n != n for n in norms) else max(norms)
    return sum(loss for loss, _ in per_rank) / dp_size, norm


class DeviceBands:
    """The device twin of integrity.StepHistory and its bands: the last `check_window` accepted
    (loss, grad norm) pairs in a float64 ring (NaN: empty), appended without a host read, and
    loaded from the host's history at each log interval."""

    def __init__(self, cfg: IntegrityConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.load(StepHistory.build(cfg.check_window))

    def load(self, history: StepHistory) -> None:
        ring = torch.full((2, self.cfg.check_window), math.nan, dtype=torch.float64)
        ring[0, : len(history.losses)] = torch.tensor(list(history.losses), dtype=torch.float64)
        ring[1, : len(history.norms)] = torch.tensor(list(history.norms), dtype=torch.float64)
        self.ring = ring.to(self.device)
        self.position = torch.tensor([len(history.losses) % self.cfg.check_window], device=self.device)

    def _upper_edge(self, row: int, factor: float, enabled: bool) -> torch.Tensor:
        """integrity.compute_band_upper over the ring's values; inf while fewer than check_min_history."""
        if not enabled:
            return torch.full((), math.inf, dtype=torch.float64, device=self.device)  # a fill, not a copy
        values = self.ring[row]
        median = torch.nanquantile(values, 0.5)
        mad = torch.nanquantile((values - median).abs(), 0.5)
        edge = median + factor * torch.maximum(MAD_TO_STD * mad, RELATIVE_FLOOR * median.abs())
        return torch.where((~values.isnan()).sum() >= self.cfg.check_min_history, edge, math.inf)

    def flag_and_accept(self, values: torch.Tensor, dp_size: int) -> torch.Tensor:
        """FLAG_BITS of a step from its (world, 2) values (integrity.compute_step_flags on the
        device); an unflagged finite step joins the ring."""
        cfg = self.cfg
        loss = values[:, 0].double().sum() / dp_size
        norm = values[:, 1].double().max()  # max propagates a NaN
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        spiky = finite & (loss > self._upper_edge(0, cfg.spiky_loss_factor, cfg.check_for_spiky_loss))
        large = finite & (norm > self._upper_edge(1, cfg.large_grads_factor, cfg.check_for_large_grads))
        code = (~finite).float() * float(cfg.check_for_nan_in_loss_and_grad) + spiky.float() * 2 + large.float() * 4
        accept = finite & (code == 0)
        current = self.ring.index_select(1, self.position)
        self.ring.index_copy_(1, self.position, torch.where(accept, torch.stack([loss, norm]).view(2, 1), current))
        self.position = (self.position + accept.long()) % cfg.check_window
        return code


def decode_flags(code: float) -> tuple[str, ...]:
    return tuple(name for name, bit in FLAG_BITS if int(code) & bit)


class StepValidator:
    """Runs steps under --rerun-mode validate_results or report_stats (see the module docstring)."""

    def __init__(self, cfg: IntegrityConfig):
        self.cfg, self.history = cfg, StepHistory.build(cfg.check_window)
        self.validate = cfg.rerun_mode == "validate_results"
        self._bands: DeviceBands | None = None  # built on the first step (it needs the device)
        self._hold: torch.Tensor | None = None  # 1 once a step of this interval was flagged
        self.spread = (0.0, 0.0)  # the largest |loss delta|, |grad norm delta| report_stats has seen

    def run_step(self, trainer):
        """One step under the rerun mode; its pending metrics carry a StepCheck (None: unchecked)."""
        if not self.validate and (trainer.iteration + 1) % self.cfg.rerun_stats_interval:
            return trainer._execute_step()
        point = capture_replay_point(trainer)
        if self.validate:
            record = {}
            pending = trainer._execute_step(0, gate=lambda *a: self._check(trainer, record, *a))
            return replace(pending, check=StepCheck(point, record["values"], code=record["code"]))
        first = self._execute_held(trainer, 0)
        restore_replay_point(trainer, point)
        second = self._execute_held(trainer, 1)
        trainer.optimizer.apply_step(second.prepared)
        return replace(second, check=StepCheck(point, first.check, rerun_values=second.check))

    def _check(self, trainer, record: dict, loss, norm, prepared):
        """The gate of a validated step: flags on the device; a flag holds this and later updates."""
        if self._bands is None:
            self._bands = DeviceBands(self.cfg, trainer.device)
            self._hold = torch.zeros((), device=trainer.device)
        record["values"] = values = gather_step_values(trainer, loss, norm)
        code = self._bands.flag_and_accept(values, trainer.job.layout.dp_size)
        if prepared.grad_norm is None:  # an fp16 overflow: the loss scaler's business, not a flag
            code = torch.zeros_like(code)
        record["code"] = code
        self._hold = torch.maximum(self._hold, (code > 0).float())
        return True, self._hold

    @staticmethod
    def _execute_held(trainer, attempt: int):
        """An execution whose update is left out; its StepCheck slot holds its device values."""
        values = {}

        def hold(loss, norm, prepared):
            values["v"] = gather_step_values(trainer, loss, norm)
            return False, None

        return replace(trainer._execute_step(attempt, gate=hold), check=values["v"])

    # -- at the log interval ------------------------------------------------------------------
    def settle(self, trainer, steps: list) -> tuple[list, bool]:
        """The interval's steps with their flags and rerun reports, and whether a flagged step
        was executed again (the held steps after it are then dropped: the list is shorter and
        its last step new)."""
        checked = [i for i, st in enumerate(steps) if st.check is not None]
        if not checked:
            return steps, False
        dp = trainer.job.layout.dp_size
        if not self.validate:
            return [self._report_stats(st, dp) if st.check is not None else st for st in steps], False
        codes = torch.stack([steps[i].check.code for i in checked]).cpu().tolist()
        values = torch.stack([steps[i].check.values for i in checked]).cpu().tolist()
        out, rerun_at = list(steps), None
        for i, code, v in zip(checked, codes, values):
            if code:
                rerun_at = i
                break
            self.history.accept(*compute_global_values(v, dp))
            out[i] = replace(steps[i], flags=())
        if rerun_at is not None:
            first = values[checked.index(rerun_at)]
            out = out[:rerun_at] + [
                self._rerun(trainer, steps[rerun_at], first, decode_flags(codes[checked.index(rerun_at)]))
            ]
        self._next_interval(trainer)
        return out, rerun_at is not None

    def _report_stats(self, st, dp: int):
        first, second = st.check.values.cpu().tolist(), st.check.rerun_values.cpu().tolist()
        (loss, norm), (loss2, norm2) = compute_global_values(first, dp), compute_global_values(second, dp)
        deltas = (abs(loss2 - loss), abs(norm2 - norm))
        self.spread = tuple(max(a, b) for a, b in zip(self.spread, deltas))
        report = {
            "mode": "report_stats",
            "ranks": compute_differing_ranks(first, second),
            "loss_delta": deltas[0],
            "grad_norm_delta": deltas[1],
        }
        return replace(st, rerun=report)

    def _next_interval(self, trainer) -> None:
        """The device's ring from the host's accepted history (held steps' entries dropped), no hold."""
        if self._bands is not None:
            self._bands.load(self.history)
        self._hold = torch.zeros((), device=trainer.device)

    def _rerun(self, trainer, flagged, first: list, flags: tuple[str, ...]):
        """Execute the flagged step again from its ReplayPoint and classify it (module docstring)."""
        point, dp = flagged.check.replay, trainer.job.layout.dp_size
        observer = trainer.replay_observer  # e.g. MegaScope's training view (see Trainer)
        if observer is not None:
            observer.flagged(point.iteration, flags)  # the flagged execution's grads are still in place
        restore_replay_point(trainer, point)
        with observer.replaying(point.iteration) if observer is not None else contextlib.nullcontext():
            second = self._execute_held(trainer, 1)
        again = second.check.cpu().tolist()
        ranks = compute_differing_ranks(first, again)
        report = {"flag": list(flags), "deterministic": self.cfg.deterministic, "ranks": ranks}
        difference = spread = None
        if ranks and not self.cfg.deterministic:  # the run's own spread, measured on this step
            restore_replay_point(trainer, point)
            second, previous = self._execute_held(trainer, 2), again
            again = second.check.cpu().tolist()
            globals_ = [compute_global_values(v, dp) for v in (first, previous, again)]
            difference = tuple(abs(a - b) for a, b in zip(globals_[0], globals_[1]))
            spread = tuple(abs(a - b) for a, b in zip(globals_[1], globals_[2]))
            report["spread"] = {"loss": spread[0], "grad_norm": spread[1]}
        verdict = report["verdict"] = compute_rerun_verdict(
            ranks, deterministic=self.cfg.deterministic, difference=difference, spread=spread
        )
        trainer.tracer.mark_iteration(point.iteration, "rerun", verdict=verdict, flag=",".join(flags))
        if observer is not None:
            observer.classified(point.iteration, report)
        loss, norm = compute_global_values(again, dp)
        if verdict == "transient" and not compute_step_flags(
            loss, norm, self.history.losses, self.history.norms, self.cfg
        ):
            self.history.accept(loss, norm)
        if verdict == "reproducible" and self.cfg.skip_spiky_batches:  # consumed, not applied
            trainer.optimizer.skipped_iterations += 1
            report["skipped"] = True
            return replace(
                second,
                skipped_nonfinite=None,
                flags=flags,
                rerun=report,
                skipped_iterations=trainer.optimizer.skipped_iterations,
                check=None,
            )
        trainer.optimizer.apply_step(second.prepared)
        return replace(second, flags=flags, rerun=report, check=None)
