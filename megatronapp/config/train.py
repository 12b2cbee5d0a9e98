"""The schedule and batches of a training run."""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.config.errors import ConfigError
from megatronapp.config.model import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, RecomputeConfig
from megatronapp.flags import BOOLEAN_OPTIONAL, field_flag

# looped-bfs is the static breadth-first schedule (PyTorch's ScheduleLoopedBFS); "breadth-first" is
# one of MegaDPP's run-time traversals (--dpp-traversal), which picks tasks in the same order
SCHEDULES = ("1f1b", "gpipe", "interleaved", "looped-bfs", "zb-h1", "interleaved-zb", "dynamic")
# schedules whose backward runs as I (input grad) and W (weight grads) tasks: pipeline/zero_bubble.py
SPLIT_SCHEDULES = ("zb-h1", "interleaved-zb")
# --attention-backend: SDPA's own backends, one preferred and the rest as fallbacks (model/attention_kernels.py)
ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")


@dataclass(frozen=True)
class TrainConfig:
    """Batches, iterations, the pipeline schedule and how each step computes (Megatron's names)."""

    micro_batch_size: int = 2
    global_batch_size: int = 16
    train_iters: int = 100
    seed: int = 1234
    schedule: str = "1f1b"  # one of SCHEDULES; interleaved needs virtual stages; dynamic: megatronapp/dpp
    compile: bool = False  # torch.compile each block's local math (GPU; see model.gpt.apply_compile)
    overlap_grad_reduce: bool = True
    grad_bucket_mb: float = 25.0
    # split backward (parallel/wgrad_defer.py): each backward runs as I (input gradient) and W
    # (deferred weight-gradient GEMMs). None: as the schedule needs (on for the zero-bubble
    # schedules and for dynamic, whose ranks fill their waits with W, unless --compile; off
    # for the others)
    split_backward: bool | None = None
    # static schedules: receives posted ahead of the schedule's RECV actions and single isends
    # (pipeline/transport.py); gloo only (NCCL needs the schedule's batches). Off by default:
    # MegaScan's slow-link attribution reads the batched transport's timing (BENCHMARKS.md)
    pipeline_recv_ahead: bool = False
    sequence_parallel: bool = False  # needs TP > 1 (Megatron's --sequence-parallel)
    # RecomputeConfig's fields, flat (as the --recompute-* flags name them); it owns their
    # defaults and checks (recompute_config())
    recompute_granularity: str = RecomputeConfig.granularity
    recompute_method: str = RecomputeConfig.method
    recompute_num_layers: int = RecomputeConfig.num_layers
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS (model/attention_kernels.py)

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "train_iters"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose from {', '.join(SCHEDULES)}")
        self._check_split_backward()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"unknown attention backend {self.attention_backend!r}; choose from {', '.join(ATTENTION_BACKENDS)}"
            )
        try:
            self.recompute_config()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def uses_split_backward(self) -> bool:
        """Whether backward runs as I and W tasks (split_backward, resolved against the schedule)."""
        if self.split_backward is not None:
            return self.split_backward
        return self.schedule in SPLIT_SCHEDULES or (self.schedule == "dynamic" and not self.compile)

    def _check_split_backward(self) -> None:
        if self.split_backward is False and self.schedule in SPLIT_SCHEDULES:
            raise ConfigError(
                f"schedule {self.schedule!r} runs W tasks apart from their backward; "
                f"it needs the split backward (drop --no-split-backward)"
            )
        if self.compile and self.uses_split_backward():
            raise ConfigError(
                "--compile cannot be combined with the split backward (a compiled backward "
                "would trace the deferral of weight GEMMs once); pass --no-split-backward "
                "or a schedule without W tasks"
            )

    def recompute_config(self) -> RecomputeConfig:
        return RecomputeConfig(self.recompute_granularity, self.recompute_method, self.recompute_num_layers)


# `megatronapp train` flags for TrainConfig's fields (Megatron's names), one tuple per --help
# group they appear in (cli/args.py); TRAIN_FLAGS is all of them
TRAIN_PARALLELISM_FLAGS = (
    field_flag(
        "--sequence-parallel",
        "shard LayerNorm/dropout/residual regions along the sequence (needs TP > 1)",
        action="store_true",
    ),
    field_flag("--overlap-grad-reduce", "overlap the DP reduction with backward (default)", action=BOOLEAN_OPTIONAL),
    field_flag(
        "--split-backward",
        "run each backward as I (input gradient, sent upstream) and W "
        "(weight-gradient GEMMs, later); default: on for zb-h1, interleaved-zb and dynamic (W filling)",
        action=BOOLEAN_OPTIONAL,
    ),
    field_flag(
        "--pipeline-recv-ahead",
        "static schedules: post receives ahead of the schedule's and send with single isends "
        "(CPU/gloo only; default: off)",
        action=BOOLEAN_OPTIONAL,
    ),
)
TRAIN_BATCH_FLAGS = (
    field_flag("--micro-batch-size", type=int),
    field_flag("--global-batch-size", type=int),
    field_flag("--train-iters", type=int),
)
# the seed and how each step computes
TRAIN_STEP_FLAGS = (
    field_flag("--seed", type=int),
    field_flag("--compile", "torch.compile each block's local math", action="store_true"),
    field_flag("--recompute-granularity", "activation recompute", choices=RECOMPUTE_GRANULARITIES[1:]),
    field_flag("--recompute-method", "for full recompute", choices=RECOMPUTE_METHODS),
    field_flag("--recompute-num-layers", "layers per group (uniform) or per chunk (block)", type=int),
    field_flag("--attention-backend", "preferred SDPA kernel (others remain as fallbacks)", choices=ATTENTION_BACKENDS),
)
TRAIN_FLAGS = (*TRAIN_PARALLELISM_FLAGS, *TRAIN_BATCH_FLAGS, *TRAIN_STEP_FLAGS)
