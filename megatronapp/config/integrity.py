"""Step checks, reruns of flagged steps and deterministic execution."""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.config.errors import ConfigError
from megatronapp.flags import BOOLEAN_OPTIONAL, Flag, field_flag

RERUN_MODES = ("disabled", "validate_results", "report_stats")


@dataclass(frozen=True)
class IntegrityConfig:
    """Per-step checks, reruns of flagged steps and deterministic execution (Megatron's
    --check-for-* flags, --rerun-mode and --deterministic-mode; engine/integrity.py, engine/rerun.py).

    A band is robust: the median of the last `check_window` accepted steps +- factor x their
    scaled median absolute deviation; a step is judged once `check_min_history` steps are in it.
    """

    check_for_nan_in_loss_and_grad: bool = True  # a non-finite loss or grad norm skips the update
    check_for_spiky_loss: bool = False  # flag a loss outside the band of recent losses
    check_for_large_grads: bool = False  # flag a grad norm above the band of recent norms
    spiky_loss_factor: float = 10.0
    large_grads_factor: float = 10.0
    check_window: int = 20
    check_min_history: int = 5
    # validate_results: a flagged step is restored and executed again, and classified;
    # report_stats: every rerun_stats_interval-th step is executed twice and the differences reported
    rerun_mode: str = "disabled"
    rerun_stats_interval: int = 10
    skip_spiky_batches: bool = False  # validate_results: a reproducibly flagged step is not applied
    deterministic: bool = False  # bit-identical reruns (engine/determinism.py)

    def __post_init__(self) -> None:
        if self.rerun_mode not in RERUN_MODES:
            raise ConfigError(f"unknown rerun mode {self.rerun_mode!r}; choose from {', '.join(RERUN_MODES)}")
        for name in ("spiky_loss_factor", "large_grads_factor"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 2 <= self.check_min_history <= self.check_window:
            raise ConfigError(
                f"need 2 <= check_min_history ({self.check_min_history}) <= check_window ({self.check_window})"
            )
        if self.rerun_stats_interval < 1:
            raise ConfigError(f"rerun_stats_interval must be >= 1, got {self.rerun_stats_interval}")
        if self.skip_spiky_batches and self.rerun_mode != "validate_results":
            raise ConfigError("--skip-spiky-batches needs --rerun-mode validate_results")

    @property
    def band_checks(self) -> bool:
        return self.check_for_spiky_loss or self.check_for_large_grads


# `megatronapp train` flags for IntegrityConfig's fields (Megatron's names)
INTEGRITY_FLAGS = (
    field_flag(
        "--check-for-nan-in-loss-and-grad",
        "a non-finite loss or grad norm skips the update; the rank and parameter are named (default)",
        action=BOOLEAN_OPTIONAL,
    ),
    field_flag(
        "--check-for-spiky-loss", "flag a loss above median + factor x MAD of recent steps", action="store_true"
    ),
    field_flag(
        "--check-for-large-grads", "flag a grad norm above median + factor x MAD of recent steps", action="store_true"
    ),
    field_flag("--spiky-loss-factor", "band width in scaled MADs", type=float),
    field_flag("--large-grads-factor", "band width in scaled MADs", type=float),
    field_flag("--check-window", "recent accepted steps in the band", type=int),
    field_flag("--check-min-history", "steps before the band is used", type=int),
    field_flag(
        "--rerun-mode",
        "validate_results: check each step before its update (on the device), re-execute a flagged "
        "step from the same weights at the log interval and classify it transient or reproducible; "
        "report_stats: execute every --rerun-stats-interval-th step twice and report the differences",
        choices=RERUN_MODES,
    ),
    field_flag("--rerun-stats-interval", "report_stats: every N-th step", type=int),
    field_flag(
        "--skip-spiky-batches", "validate_results: a reproducibly flagged step is not applied", action="store_true"
    ),
    field_flag(
        "--deterministic",
        "bit-identical reruns: deterministic kernels and attention, fixed "
        "NCCL algorithm (Megatron's --deterministic-mode)",
        action="store_true",
    ),
    # Megatron-LM's own spelling of --deterministic, accepted but not listed in --help
    Flag("--deterministic-mode", "deterministic", kwargs={"action": "store_true"}, hidden=True),
)
