"""AdamW, its learning-rate schedule, clipping and where its state lives."""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.config.errors import ConfigError
from megatronapp.flags import BOOLEAN_OPTIONAL, Flag, field_flag

# Megatron-Core's choices for the precision-aware optimizer's state (OptimizerConfig)
STATE_DTYPE_CHOICES = {
    "main_params_dtype": ("fp32", "fp16"),
    "main_grads_dtype": ("fp32", "bf16"),
    "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"),
    "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8"),
}


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, its learning-rate schedule (linear warm-up, cosine decay to min_lr), clipping and
    where its state lives (engine/optim.py, engine/mixed_precision.py)."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 10
    lr_decay_iters: int = 0  # 0 -> train_iters
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    use_distributed_optimizer: bool = False  # ZeRO-1: optimizer state sharded over DP
    overlap_param_gather: bool = False  # distributed optimizer: all-gather params during the next forward
    # bf16/fp16 on CUDA: one Triton kernel per tensor does AdamW on the fp32 master weight, the
    # clip and the write of the model weight (as TE's FusedAdam with master weights; engine/master_adam.py)
    fused_master_adamw: bool = True
    # the fused master AdamW on a side stream, unit by unit, beside the next step's forward
    # (engine/overlap_update.py); CUDA only
    overlap_param_update: bool = False
    # Megatron-Core's precision-aware optimizer (engine/precision_adam.py): masters and Adam
    # moments stored at these precisions, updated in fp32; main grads accumulated and reduced
    # over DP in main_grads_dtype
    use_precision_aware_optimizer: bool = False
    main_params_dtype: str = "fp32"
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    # precision-aware with --bf16 and fp32 masters: each master is its bf16 weight + an int16 remainder
    store_param_remainders: bool = True

    def __post_init__(self) -> None:
        self._check_state_precision()
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.clip_grad < 0:
            raise ConfigError(f"clip_grad must be >= 0, got {self.clip_grad}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")

    def _check_state_precision(self) -> None:
        """The precision-aware optimizer's dtypes: Megatron's choices, of which the engine stores
        fp32/fp16/bf16 masters and moments."""
        for name, allowed in STATE_DTYPE_CHOICES.items():
            value, flag = getattr(self, name), "--" + name.replace("_", "-")
            if value not in allowed:
                raise ConfigError(f"unknown {flag} {value!r}; choose from {', '.join(allowed)}")
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise ConfigError(f"{flag} {value} needs --use-precision-aware-optimizer")
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) == "fp8":
                raise ConfigError(
                    f"--{name.replace('_', '-')} fp8 is not supported: Adam moments are fp32, fp16 or bf16"
                )

    @property
    def state_is_fp32(self) -> bool:
        """Whether every master and moment is stored in fp32 (the plain optimizer's state)."""
        names = ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        return all(getattr(self, n) == "fp32" for n in names)


# `megatronapp train` flags for OptimizerConfig's fields (Megatron's names), one tuple per --help
# group they appear in (cli/args.py); OPTIMIZER_FLAGS is all of them
OPTIMIZER_PARALLELISM_FLAGS = (
    field_flag(
        "--fused-master-adamw",
        "bf16/fp16 on CUDA: AdamW on the fp32 master weights writes the model weights in the same kernel (default)",
        action=BOOLEAN_OPTIONAL,
    ),
    field_flag(
        "--overlap-param-update",
        "CUDA: the fused master AdamW runs layer by layer on a side stream beside the next forward",
        action="store_true",
    ),
)
# AdamW, its learning-rate schedule and clipping
OPTIMIZER_SCHEDULE_FLAGS = (
    field_flag("--lr", type=float),
    field_flag("--min-lr", type=float),
    field_flag("--lr-warmup-iters", type=int),
    field_flag("--lr-decay-iters", type=int),
    field_flag("--weight-decay", type=float),
    field_flag("--adam-beta1", type=float),
    field_flag("--adam-beta2", type=float),
    field_flag("--adam-eps", type=float),
    field_flag("--clip-grad", type=float),
)
# where the optimizer's state lives and at which precisions
OPTIMIZER_STATE_FLAGS = (
    field_flag(
        "--use-distributed-optimizer", "shard fp32 master weights and Adam state over DP (ZeRO-1)", action="store_true"
    ),
    field_flag(
        "--overlap-param-gather",
        "distributed optimizer: all-gather updated params during the next forward",
        action="store_true",
    ),
    field_flag(
        "--use-precision-aware-optimizer",
        "store masters and Adam moments at the dtypes below, update them in fp32 (Megatron-Core's)",
        action="store_true",
    ),
    *(
        field_flag("--" + name.replace("_", "-"), "with --use-precision-aware-optimizer", choices=choices)
        for name, choices in STATE_DTYPE_CHOICES.items()
    ),
    field_flag(
        "--store-param-remainders",
        "precision-aware, --bf16, fp32 masters: keep each master as its bf16 weight + a 16-bit remainder (default)",
        action="store_true",
    ),
    Flag(
        "--no-store-param-remainders",
        "store_param_remainders",
        "keep whole fp32 master weights instead of the bf16 weight + remainder",
        {"action": "store_false"},
    ),
)
OPTIMIZER_FLAGS = (*OPTIMIZER_PARALLELISM_FLAGS, *OPTIMIZER_SCHEDULE_FLAGS, *OPTIMIZER_STATE_FLAGS)
