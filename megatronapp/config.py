"""Configuration dataclasses, the one place their defaults are written: the model (with named
presets) and one config per component of a training job (schedule and batches, optimizer,
precision, checkpoints, logging, step checks), nested in JobConfig.

Each config checks its own fields when built. The rules between configs and against the
parallel layout are job.validate_job's, which the CLI calls before any process is launched,
so a bad combination fails with one line instead of a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatronapp.parallel.fp8 import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES
from megatronapp.parallel.layout import LayoutError, ParallelLayout


class ConfigError(ValueError):
    """A configuration that cannot work; the message says why in one line."""


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute (Megatron's --recompute-*); model/recompute.py applies it."""

    granularity: str = "none"  # none | selective | full
    method: str = "uniform"  # uniform | block (full only)
    num_layers: int = 1  # layers per group (uniform) or layers per chunk recomputed (block)

    def __post_init__(self) -> None:
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"unknown recompute granularity {self.granularity!r}; choose from {', '.join(RECOMPUTE_GRANULARITIES)}"
            )
        if self.method not in RECOMPUTE_METHODS:
            raise ValueError(f"unknown recompute method {self.method!r}; choose from {', '.join(RECOMPUTE_METHODS)}")
        if self.num_layers < 1:
            raise ValueError(f"recompute num layers must be >= 1, got {self.num_layers}")


@dataclass(frozen=True)
class ModelConfig:
    """GPT decoder shape. Positions are rotary (RoPE): no position table to shard or pipe.

    The defaults are the GPT-NeoX family (LayerNorm, GeLU MLP, biases, multi-head attention,
    untied output layer); the Llama family sets RMSNorm, SwiGLU, grouped-query attention
    (`num_query_groups` key/value heads shared by the query heads), no linear biases (Qwen2:
    a QKV bias) and tied embeddings. Field names follow Megatron-LM's flags.
    """

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int = 0  # 0 -> 4 * hidden_size
    vocab_size: int = 257  # tokenizer vocabulary before padding
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 64
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    rotary_base: float = 10000.0
    hidden_dropout: float = 0.1  # Megatron-LM's defaults; every preset below sets 0.0
    attention_dropout: float = 0.1
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    swiglu: bool = False  # MLP: fc2(silu(gate(x)) * fc1(x)) instead of fc2(gelu(fc1(x)))
    num_query_groups: int | None = None  # key/value heads (grouped-query attention); None: one per head
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # a bias on the QKV projection even without add_bias_linear
    untie_embeddings_and_output_weights: bool = True  # False: the output layer is the input embedding

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"hidden size {self.hidden_size} is not divisible by num attention heads {self.num_attention_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head dim {self.head_dim} must be even for rotary embeddings")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"unknown normalization {self.normalization!r}; choose from {', '.join(NORMALIZATIONS)}")
        if self.num_query_groups is not None and (
            self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups
        ):
            raise ConfigError(
                f"num attention heads {self.num_attention_heads} is not divisible by num query groups "
                f"{self.num_query_groups}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: num_query_groups, or one per attention head (multi-head attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def padded_vocab_size(self) -> int:
        # Padding does not depend on TP (unlike Megatron), so every layout trains the
        # same model; divisibility by TP is checked in validate_job instead.
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    def num_parameters(self, include_input_embedding: bool = True) -> int:
        h, f, v, n = self.hidden_size, self.ffn_size, self.padded_vocab_size, self.num_layers
        norm = h if self.normalization == "RMSNorm" else 2 * h
        qkv_out = h + 2 * self.query_groups * self.head_dim
        bias = int(self.add_bias_linear)
        attention = qkv_out * h + qkv_out * int(self.qkv_bias) + h * h + h * bias
        fc1s = 2 if self.swiglu else 1
        mlp = fc1s * (h * f + f * bias) + f * h + h * bias
        per_layer = 2 * norm + attention + mlp
        # tied: the output layer is the input embedding, counted once (as the output layer
        # when the input embedding is left out)
        embedding = v * h if include_input_embedding and self.untie_embeddings_and_output_weights else 0
        return n * per_layer + embedding + v * h + norm

    def flops_per_token(self) -> float:
        """Training FLOPs per token, the one convention for every MFU we report:
        6 * N with N excluding the input embedding (a lookup, not a matmul; the output layer
        counts) + 12 * layers * hidden * seq for attention scores and values."""
        n = self.num_parameters(include_input_embedding=False)
        return 6.0 * n + 12.0 * self.num_layers * self.hidden_size * self.seq_length


_NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)  # as current LLM pretraining recipes
_LLAMA = dict(
    normalization="RMSNorm",
    layernorm_epsilon=1e-5,
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=False,
)
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, **_NO_DROPOUT),
    "demo": ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, **_NO_DROPOUT),
    "small": ModelConfig(num_layers=12, hidden_size=512, num_attention_heads=8, seq_length=256, **_NO_DROPOUT),
    "125m": ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, **_NO_DROPOUT),
    "350m": ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=2048, **_NO_DROPOUT),
    "1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, **_NO_DROPOUT),
    # Llama 3.2 1B's shape (its vocabulary comes from --tokenizer-model, as for every preset)
    "llama3.2-1b": ModelConfig(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=8192,
        seq_length=2048,
        rotary_base=500000.0,
        **_LLAMA,
        **_NO_DROPOUT,
    ),
    "llama-tiny": ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        seq_length=32,
        rotary_base=500000.0,
        **_LLAMA,
        **_NO_DROPOUT,
    ),
}


def model_preset(name: str, **overrides) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose from {', '.join(MODEL_PRESETS)}")
    return replace(MODEL_PRESETS[name], **overrides)


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


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision as Megatron: bf16/fp16 params and activations, fp32 main grads and master
    weights (engine.mixed_precision). fp16 uses loss scaling: static when loss_scale is set, else
    dynamic (engine.grad_scaler). FP8 GEMMs in the transformer layers' linears (parallel/fp8.py),
    with bf16 or fp16: Megatron's --fp8-format e4m3|hybrid, --fp8-recipe tensorwise|delayed and
    the delayed recipe's amax history, compute algorithm and margin (Megatron's defaults)."""

    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    fp8_format: str | None = None
    fp8_recipe: str = "tensorwise"
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_margin: int = 0
    first_last_layers_bf16: bool = False  # Megatron's: the first / last layers' GEMMs stay bf16
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    # bf16/fp16: weight-gradient GEMMs accumulate straight into the fp32 main grads
    # (Megatron's --gradient-accumulation-fusion, on by default there too; parallel/wgrad_fusion.py)
    gradient_accumulation_fusion: bool = True

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are mutually exclusive")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"loss_scale must be > 0, got {self.loss_scale}")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ConfigError(
                f"need 0 < min_loss_scale ({self.min_loss_scale}) <= initial_loss_scale ({self.initial_loss_scale})"
            )
        for name in ("loss_scale_window", "hysteresis"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_fp8()

    @property
    def half(self) -> bool:
        """bf16 or fp16 params and activations."""
        return self.bf16 or self.fp16

    def fp8_layers(self, num_layers: int) -> range:
        """Global indices of the layers whose GEMMs run in FP8 (empty without --fp8-format).
        --first-last-layers-bf16 keeps the layers nearest the embedding and the output in bf16:
        they are the most sensitive to FP8's rounding (Megatron's option)."""
        if self.fp8_format is None:
            return range(0)
        if not self.first_last_layers_bf16:
            return range(num_layers)
        return range(self.num_layers_at_start_in_bf16, num_layers - self.num_layers_at_end_in_bf16)

    def _check_fp8(self) -> None:
        if self.fp8_format is not None:
            if self.fp8_format not in FP8_FORMATS:
                raise ConfigError(f"unknown fp8 format {self.fp8_format!r}; choose from {', '.join(FP8_FORMATS)}")
            if not self.half:
                raise ConfigError("--fp8-format needs --bf16 or --fp16 (FP8 GEMMs, the rest in bf16/fp16, as Megatron)")
        if self.first_last_layers_bf16 and self.fp8_format is None:
            raise ConfigError("--first-last-layers-bf16 needs --fp8-format")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"fp8 recipe {self.fp8_recipe!r} is not built; choose from {', '.join(FP8_RECIPES)}")
        if self.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ConfigError(
                f"unknown fp8 amax compute algo {self.fp8_amax_compute_algo!r}; choose from "
                f"{', '.join(AMAX_COMPUTE_ALGOS)}"
            )
        if self.fp8_amax_history_len < 1 or self.fp8_margin < 0:
            raise ConfigError(
                f"need fp8_amax_history_len >= 1 and fp8_margin >= 0, got "
                f"{self.fp8_amax_history_len} and {self.fp8_margin}"
            )


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


@dataclass(frozen=True)
class JobConfig:
    """One training job: the model, its layout, and one config per component of the engine."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    layout: ParallelLayout = field(default_factory=lambda: ParallelLayout(world_size=1))
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.layout.dp_size)


def build_layout(
    world_size: int, tp_size: int, pp_size: int, virtual_pp_size: int = 1, stage_layers: tuple[int, ...] = ()
) -> ParallelLayout:
    try:
        return ParallelLayout(world_size, tp_size, pp_size, virtual_pp_size, stage_layers)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
