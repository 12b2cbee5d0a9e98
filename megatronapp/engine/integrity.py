"""Per-step checks: pure decisions over a step's loss and grad norm and the recent history.

A step is flagged
  * "nan": its loss or grad norm is not finite (the update is skipped on the device, see
    MixedPrecisionOptimizer.step; this module only names it);
  * "spiky_loss": its loss is above the robust band of the recent accepted losses;
  * "large_grads": its grad norm is above the robust band of the recent accepted norms.

Robust band of values x (Hampel's rule): median(x) + factor * max(1.4826 * MAD(x), 1e-3 * |median(x)|),
MAD the median absolute deviation (1.4826 * MAD estimates the standard deviation of normal
data, and is not moved by the outliers it is meant to find). The floor keeps a flat history
(MAD 0) from flagging every rounding step. Only the upper side counts: a falling loss or norm
is training, not a fault. A band is used once `check_min_history` values are in it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from megatronapp.config import IntegrityConfig

MAD_TO_STD = 1.4826
RELATIVE_FLOOR = 1e-3


def compute_band_upper(values, factor: float) -> float:
    """The robust band's upper edge over `values` (see the module docstring)."""
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return median + factor * max(MAD_TO_STD * mad, RELATIVE_FLOOR * abs(median))


def is_above_band(value: float, history, factor: float, min_history: int) -> bool:
    """Whether `value` is above the band of `history`; False while the history is short."""
    return len(history) >= min_history and value > compute_band_upper(history, factor)


def compute_step_flags(loss: float, grad_norm: float, losses, norms, cfg: IntegrityConfig) -> tuple[str, ...]:
    """The flags of one step (empty: the step is fine), from its values and the accepted history."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return ("nan",) if cfg.check_for_nan_in_loss_and_grad else ()
    flags = []
    if cfg.check_for_spiky_loss and is_above_band(loss, losses, cfg.spiky_loss_factor, cfg.check_min_history):
        flags.append("spiky_loss")
    if cfg.check_for_large_grads and is_above_band(grad_norm, norms, cfg.large_grads_factor, cfg.check_min_history):
        flags.append("large_grads")
    return tuple(flags)


@dataclass
class StepHistory:
    """The last `window` accepted (unflagged or validated) losses and grad norms."""

    losses: deque
    norms: deque

    @classmethod
    def build(cls, window: int) -> StepHistory:
        return cls(deque(maxlen=window), deque(maxlen=window))

    def judge(self, loss: float, grad_norm: float, cfg: IntegrityConfig) -> tuple[str, ...]:
        """The step's flags; an unflagged step joins the history."""
        flags = compute_step_flags(loss, grad_norm, self.losses, self.norms, cfg)
        if not flags:
            self.accept(loss, grad_norm)
        return flags

    def accept(self, loss: float, grad_norm: float) -> None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # unchecked non-finite steps stay out
            return
        self.losses.append(loss)
        self.norms.append(grad_norm)


def compute_differing_ranks(first: list[tuple[float, ...]], second: list[tuple[float, ...]]) -> list[int]:
    """Ranks whose values differ between two executions of a step, bit for bit (nan equals nan)."""

    def same(a: float, b: float) -> bool:
        return a == b or (math.isnan(a) and math.isnan(b))

    return [r for r, (a, b) in enumerate(zip(first, second)) if not all(same(x, y) for x, y in zip(a, b))]


def compute_rerun_verdict(
    differing_ranks: list[int],
    *,
    deterministic: bool = True,
    difference: tuple[float, ...] | None = None,
    spread: tuple[float, ...] | None = None,
) -> str:
    """Same values on every rank: the step's outcome follows from its inputs (reproducible).
    A difference in a deterministic run: something other than the inputs decided it (a
    transient fault). Otherwise the kernels may differ from run to run: the difference of the
    (loss, grad norm) between the flagged execution and its rerun within the `spread` between
    two reruns is reproducible, beyond it (or with no spread measured) transient."""
    if not differing_ranks:
        return "reproducible"
    if deterministic or difference is None or spread is None:
        return "transient"
    return "reproducible" if all(d <= s for d, s in zip(difference, spread)) else "transient"


def compare_runs(first: list[dict], second: list[dict]) -> dict:
    """Bit-for-bit comparison of two runs' per-step loss and grad norm (metrics-file records;
    floats from JSON round-trip exactly): how a --deterministic run is checked."""
    differing = [
        a["iteration"] for a, b in zip(first, second) if (a["loss"], a["grad_norm"]) != (b["loss"], b["grad_norm"])
    ]
    return {
        "steps": min(len(first), len(second)),
        "identical": not differing and len(first) == len(second),
        "first_differing_iteration": differing[0] if differing else None,
        "differing_steps": len(differing),
    }


def tabulate_flagged(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per flagged step of every run (name -> metrics-file records): run, iteration,
    flags, loss, grad norm, the rerun's verdict and ranks."""
    return [
        {
            "run": name,
            "iteration": r["iteration"],
            "flags": r["flags"],
            "loss": r["loss"],
            "grad_norm": r["grad_norm"],
            "verdict": (r.get("rerun") or {}).get("verdict"),
            "ranks": (r.get("rerun") or {}).get("ranks"),
        }
        for name, rows in runs.items()
        for r in rows
        if r.get("flags")
    ]
