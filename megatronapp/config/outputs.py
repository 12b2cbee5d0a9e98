"""What a run writes and reads besides the model: checkpoints, logs, evaluation."""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.config.errors import ConfigError
from megatronapp.flags import field_flag


@dataclass(frozen=True)
class CheckpointConfig:
    """Megatron's --save / --load / --save-interval (engine/checkpoint.py)."""

    save: str | None = None
    load: str | None = None  # resume from its latest checkpoint; empty or missing: start fresh
    save_interval: int = 0  # 0: save once, at the end

    def __post_init__(self) -> None:
        if self.save_interval < 0:
            raise ConfigError(f"save_interval must be >= 0, got {self.save_interval}")


@dataclass(frozen=True)
class LoggingConfig:
    """How often metrics reach the host, and where they are written (cli/metric_logs.py)."""

    log_interval: int = 1
    metrics_file: str | None = None  # JSON lines, one object per iteration
    tensorboard_dir: str | None = None  # TensorBoard event files (the `tensorboard` extra)
    wandb_project: str | None = None  # Weights & Biases, offline (the `wandb` extra)
    wandb_exp_name: str | None = None  # the W&B run's name; None: W&B's own
    wandb_save_dir: str | None = None  # where W&B writes; None: beside --save, else ./wandb

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ConfigError(f"log_interval must be >= 1, got {self.log_interval}")


@dataclass(frozen=True)
class EvalConfig:
    """Validation and test loss (Megatron's --eval-interval / --eval-iters; engine/evaluation.py).
    Off unless eval_interval is set (Megatron evaluates every 1000 steps by default)."""

    eval_interval: int | None = None  # validation loss every N steps and at the end; test loss at the end
    eval_iters: int = 100  # global batches per evaluation, from the start of each stream

    def __post_init__(self) -> None:
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ConfigError(f"eval_interval must be >= 1, got {self.eval_interval} (omit it to turn evaluation off)")
        if self.eval_iters < 1:
            raise ConfigError(f"eval_iters must be >= 1, got {self.eval_iters}")

    @property
    def enabled(self) -> bool:
        return self.eval_interval is not None


# `megatronapp train` flags for the fields of the configs above (Megatron's names)
CHECKPOINT_FLAGS = (
    field_flag("--save"),
    field_flag("--load", "resume from the latest checkpoint there; empty or missing: start fresh"),
    field_flag("--save-interval", type=int),
)
LOGGING_FLAGS = (
    field_flag("--log-interval", "metrics reach the host every N steps", type=int),
    field_flag("--metrics-file", "JSON lines, one object per iteration"),
    field_flag("--tensorboard-dir", "TensorBoard event files (pip install 'megatronapp[tensorboard]')"),
    field_flag("--wandb-project", "Weights & Biases project, logged offline (pip install 'megatronapp[wandb]')"),
    field_flag("--wandb-exp-name", "the W&B run's name"),
    field_flag("--wandb-save-dir", "where W&B writes; when not given: SAVE/wandb with --save, else ./wandb"),
)
EVAL_FLAGS = (
    field_flag(
        "--eval-interval",
        "validation loss every N steps and at the end, test loss at the end; no evaluation without it",
        type=int,
    ),
    field_flag("--eval-iters", "global batches per evaluation, from the start of each stream", type=int),
)
