"""Operations over a JobConfig: building one from flat field names, and the rules between its parts.

A flat field name (as the CLI's flags, tests and benchmarks use them: `lr`, `bf16`, `save`,
`micro_batch_size`, ...) names a field of exactly one of the job's component configs
(config/), so `build_job` and `replace_fields` route each to its component, and each changed
component checks itself again. `validate_job` checks every constraint between the components
and the parallel layout; cli/validate.py calls it before anything is launched.
"""

from __future__ import annotations

from dataclasses import replace

from megatronapp.config import (
    CheckpointConfig,
    ConfigError,
    EvalConfig,
    IntegrityConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    TrainConfig,
)
from megatronapp.data.dataset import compute_num_microbatches
from megatronapp.parallel.fp8 import FP8_ALIGNMENT
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.parallel.partition import PartitionError, compute_stage_layers

# JobConfig's component configs whose fields have distinct names, so that a flat field name (as
# the CLI's flags, tests and benchmarks use them) names one component
FIELD_COMPONENTS = {
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "integrity": IntegrityConfig,
    "eval": EvalConfig,
}


def component_of(name: str) -> str:
    """The JobConfig component owning field `name`; TypeError for a name none has."""
    for component, cls in FIELD_COMPONENTS.items():
        if name in cls.__dataclass_fields__:
            return component
    raise TypeError(f"no job config has a field {name!r}")


def replace_fields(job: JobConfig, **fields) -> JobConfig:
    """`job` with the named fields changed, each in the component config that owns it; each
    changed component checks itself again."""
    by_component: dict[str, dict] = {}
    for name, value in fields.items():
        by_component.setdefault(component_of(name), {})[name] = value
    return replace(job, **{c: replace(getattr(job, c), **kw) for c, kw in by_component.items()})


def build_job(model: ModelConfig | None = None, layout: ParallelLayout | None = None, **fields) -> JobConfig:
    """A JobConfig from flat field names (train, optimizer, precision, checkpoint, logging,
    integrity and eval fields), the dataclass defaults for the rest."""
    base = JobConfig(**{k: v for k, v in (("model", model), ("layout", layout)) if v is not None})
    return replace_fields(base, **fields)


def validate_job(job: JobConfig) -> None:
    """Check every constraint between the job's configs and its layout; ConfigError with one line."""
    _check_component_combinations(job)
    _check_layout_shapes(job)
    _check_layout_combinations(job)


def _check_component_combinations(job: JobConfig) -> None:
    """Rules between two component configs, whatever the layout."""
    opt, prec = job.optimizer, job.precision
    if opt.overlap_param_update and not (prec.half and opt.fused_master_adamw):
        raise ConfigError("--overlap-param-update needs --bf16 or --fp16 and the fused master AdamW")
    if opt.main_grads_dtype == "bf16" and not prec.bf16:
        raise ConfigError("--main-grads-dtype bf16 needs --bf16 (fp16 grads are unscaled in fp32)")
    if opt.main_params_dtype != "fp32" and not prec.half:
        raise ConfigError(
            f"--main-params-dtype {opt.main_params_dtype} needs --bf16 or --fp16 (fp32 params are their own masters)"
        )
    if job.integrity.deterministic and job.train.attention_backend == "cudnn":
        raise ConfigError(
            "--deterministic needs an attention backend with a deterministic backward "
            "(flash, efficient or math), not cudnn"
        )


def _check_layout_shapes(job: JobConfig) -> None:
    """Heads, FFN and vocabulary over TP; layers over pipeline stages; the batch over DP."""
    m, t, lay = job.model, job.train, job.layout
    if m.num_attention_heads % lay.tp_size:
        raise ConfigError(
            f"num attention heads {m.num_attention_heads} is not divisible by tensor-parallel size {lay.tp_size}"
        )
    if m.query_groups % lay.tp_size:
        raise ConfigError(f"num query groups {m.query_groups} is not divisible by tensor-parallel size {lay.tp_size}")
    if m.ffn_size % lay.tp_size:
        raise ConfigError(f"ffn hidden size {m.ffn_size} is not divisible by tensor-parallel size {lay.tp_size}")
    if m.padded_vocab_size % lay.tp_size:
        raise ConfigError(
            f"padded vocab size {m.padded_vocab_size} is not divisible by tensor-parallel size {lay.tp_size}"
        )
    try:
        compute_stage_layers(m.num_layers, lay.pp_size, lay.virtual_pp_size, per_stage=lay.stage_layers)
    except PartitionError as e:
        raise ConfigError(str(e)) from None
    try:
        compute_num_microbatches(t.global_batch_size, t.micro_batch_size, lay.dp_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_layout_combinations(job: JobConfig) -> None:
    """Sequence parallelism, FP8, the optimizer's overlap and the schedule against the layout."""
    m, t, prec, lay = job.model, job.train, job.precision, job.layout
    if t.sequence_parallel:
        if lay.tp_size < 2:
            raise ConfigError("--sequence-parallel needs tensor-parallel size > 1")
        if m.seq_length % lay.tp_size:
            raise ConfigError(
                f"--sequence-parallel needs seq length {m.seq_length} divisible by tensor-parallel size {lay.tp_size}"
            )
    if prec.fp8_format is not None:
        _check_fp8_shapes(job)
        if not prec.fp8_layers(m.num_layers):
            raise ConfigError(
                f"--num-layers-at-start-in-bf16 {prec.num_layers_at_start_in_bf16} and "
                f"--num-layers-at-end-in-bf16 {prec.num_layers_at_end_in_bf16} leave none of the "
                f"{m.num_layers} layers in FP8"
            )
    if job.optimizer.overlap_param_update and job.optimizer.use_distributed_optimizer and lay.dp_size > 1:
        raise ConfigError(
            "--overlap-param-update with --use-distributed-optimizer needs DP 1 (the all-gather "
            "follows the whole update; use --overlap-param-gather)"
        )
    if lay.virtual_pp_size > 1 and t.schedule not in ("interleaved", "interleaved-zb", "looped-bfs", "dynamic"):
        raise ConfigError(
            f"virtual pipeline stages need the interleaved, interleaved-zb, looped-bfs or "
            f"dynamic schedule, not {t.schedule!r}"
        )
    if t.schedule in ("interleaved", "interleaved-zb"):
        if lay.virtual_pp_size < 2:
            raise ConfigError(
                "the interleaved schedule needs --num-layers-per-virtual-pipeline-stage "
                "giving >= 2 virtual stages per pipeline rank"
            )
        if job.num_microbatches % lay.pp_size:
            raise ConfigError(
                f"interleaved schedule needs the number of microbatches ({job.num_microbatches}) "
                f"to be a multiple of pipeline-parallel size {lay.pp_size}"
            )


def _check_fp8_shapes(job: JobConfig) -> None:
    """FP8 GEMMs need every dimension a multiple of FP8_ALIGNMENT (parallel/fp8.py)."""
    m, tp = job.model, job.layout.tp_size
    dims = {
        "tokens per microbatch (micro batch size x seq length)": job.train.micro_batch_size * m.seq_length,
        "hidden size": m.hidden_size,
        "hidden size / tensor-parallel size": m.hidden_size // tp,
        "ffn hidden size / tensor-parallel size": m.ffn_size // tp,
        # the QKV projection's rows: query heads and a key and a value head per query group
        "qkv rows / tensor-parallel size": (m.num_attention_heads + 2 * m.query_groups) * m.head_dim // tp,
    }
    for what, value in dims.items():
        if value % FP8_ALIGNMENT:
            raise ConfigError(f"--fp8-format needs {what} ({value}) to be a multiple of {FP8_ALIGNMENT}")
