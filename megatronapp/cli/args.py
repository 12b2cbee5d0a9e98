"""`megatronapp train` flags (Megatron-LM's names) and their translation into configs.

Defaults live in one place, the config dataclasses (config/), and so do the flags that set a
field of one of the job's component configs (train, optimizer, precision, checkpoint, logging,
integrity, eval): each is declared as a `Flag` beside its config, named by that field. The
parser is built here from those declarations: they default to None, so only the flags a user
gave are passed on (job.build_job routes each to its component) and the dataclass default
applies otherwise. `--help` shows those defaults, read from the dataclasses.
"""

from __future__ import annotations

import argparse

from megatronapp.cli.architecture_args import add_architecture_arguments, compute_query_groups_override
from megatronapp.config import (
    CHECKPOINT_FLAGS,
    EVAL_FLAGS,
    INTEGRITY_FLAGS,
    LOGGING_FLAGS,
    MIXED_PRECISION_FLAGS,
    MODEL_PRESETS,
    OPTIMIZER_PARALLELISM_FLAGS,
    OPTIMIZER_SCHEDULE_FLAGS,
    OPTIMIZER_STATE_FLAGS,
    PRECISION_PARALLELISM_FLAGS,
    SCHEDULES,
    TRAIN_BATCH_FLAGS,
    TRAIN_PARALLELISM_FLAGS,
    TRAIN_STEP_FLAGS,
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
    build_layout,
    model_preset,
)
from megatronapp.data.config import add_data_arguments
from megatronapp.dpp.config import DPP_FLAGS, DppConfig
from megatronapp.dpp.rebalance import REBALANCE_FLAGS, RebalanceConfig
from megatronapp.fbd.cli import build_role_layout
from megatronapp.fbd.config import FBD_FLAGS, FBD_SWITCH, FbdConfig
from megatronapp.flags import add_flags, read_flags
from megatronapp.job import FIELD_COMPONENTS, build_job
from megatronapp.launch.flags import DEVICE, LAYOUT_FLAGS, NPROC_PER_NODE, TOKENIZER_MODEL, VIRTUAL_STAGES
from megatronapp.launch.local import RESULT_FILE
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.parallel.partition import PartitionError, compute_stage_layers
from megatronapp.scan.analyze.detect_config import DETECT_FLAGS, DetectConfig
from megatronapp.scan.record.trace_config import TRACE_FLAGS, TRACE_SWITCH, TraceConfig

_MODEL_FLAGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "seq_length",
    "make_vocab_size_divisible_by",
    "hidden_dropout",
    "attention_dropout",
    "normalization",
    "layernorm_epsilon",
    "swiglu",
    "num_query_groups",
    "add_bias_linear",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
    "rotary_base",
)


def _add_job_flags(container, *flag_sets) -> None:
    """Add each (flags, config class) of `flag_sets` to `container` as flags for fields of the
    job's component configs: default None, so the dataclass default applies unless given."""
    for flags, config_cls in flag_sets:
        add_flags(container, flags, config_cls, default_in_help_only=True)


def _given_job_fields(args: argparse.Namespace) -> dict:
    """The component-config fields whose flags were given (every such flag's dest is the field's name)."""
    names = (n for cls in FIELD_COMPONENTS.values() for n in cls.__dataclass_fields__)
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch")
    add_flags(g, (NPROC_PER_NODE,))
    g.add_argument("--nnodes", type=int, default=1, help="nodes, when launching through this command")
    add_flags(g, (DEVICE,))
    g.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    add_flags(g, (RESULT_FILE,), hidden=True)

    g = p.add_argument_group("parallelism")
    add_flags(g, LAYOUT_FLAGS, ParallelLayout)
    vpp = g.add_mutually_exclusive_group()  # Megatron's two spellings of the virtual stage count
    vpp.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved pipeline: layers per model chunk (default: one chunk per stage)",
    )
    add_flags(vpp, (VIRTUAL_STAGES,))
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="layers on the first pipeline stage; the rest split evenly (default: even split)",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="layers on the last pipeline stage; the rest split evenly (default: even split)",
    )
    g.add_argument(
        "--pipeline-stage-layers",
        type=_int_list,
        default=None,
        help="layers of every pipeline stage, e.g. 3,5,4,4 (one per pipeline rank, or one per virtual stage "
        "in Megatron's order chunk x PP + rank) (default: even split)",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=SCHEDULES,
        default=None,
        help="default: interleaved with virtual stages, else 1f1b",
    )
    _add_job_flags(
        g,
        (TRAIN_PARALLELISM_FLAGS, TrainConfig),
        (PRECISION_PARALLELISM_FLAGS, PrecisionConfig),
        (OPTIMIZER_PARALLELISM_FLAGS, OptimizerConfig),
    )

    g = p.add_argument_group("model")
    g.add_argument("--model", choices=tuple(MODEL_PRESETS), default="demo", help="preset; flags below override")
    for flag in (
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--ffn-hidden-size",
        "--seq-length",
        "--make-vocab-size-divisible-by",
    ):
        g.add_argument(flag, type=int, default=None, help="default: the preset's")
    g.add_argument(
        "--hidden-dropout",
        type=float,
        default=None,
        help=f"default: the preset's (presets 0.0; Megatron's {ModelConfig.hidden_dropout})",
    )
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help=f"default: the preset's (presets 0.0; Megatron's {ModelConfig.attention_dropout})",
    )
    add_architecture_arguments(g)

    g = p.add_argument_group("training")
    _add_job_flags(
        g,
        (TRAIN_BATCH_FLAGS, TrainConfig),
        (OPTIMIZER_SCHEDULE_FLAGS, OptimizerConfig),
        (TRAIN_STEP_FLAGS, TrainConfig),
    )

    g = p.add_argument_group("mixed precision and optimizer (Megatron's; engine/mixed_precision.py)")
    _add_job_flags(g, (MIXED_PRECISION_FLAGS, PrecisionConfig), (OPTIMIZER_STATE_FLAGS, OptimizerConfig))

    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help=".txt / Megatron-style .jsonl files or folders, or Megatron indexed datasets: PREFIX "
        "(PREFIX.bin + PREFIX.idx) or a weighted blend W1 PREFIX1 W2 PREFIX2 ...; "
        "default: the embedded synthetic corpus",
    )
    add_flags(g, (TOKENIZER_MODEL,))
    add_data_arguments(g)

    g = p.add_argument_group("validation and test (Megatron's; engine/evaluation.py)")
    _add_job_flags(g, (EVAL_FLAGS, EvalConfig))

    g = p.add_argument_group("checkpoints and logging")
    _add_job_flags(g, (CHECKPOINT_FLAGS, CheckpointConfig), (LOGGING_FLAGS, LoggingConfig))

    g = p.add_argument_group("MegaScan tracing")
    add_flags(g, (TRACE_SWITCH, *TRACE_FLAGS), TraceConfig)
    add_flags(g, DETECT_FLAGS, DetectConfig)
    g = p.add_argument_group("step checks, reruns, determinism (Megatron's; engine/integrity.py, engine/rerun.py)")
    _add_job_flags(g, (INTEGRITY_FLAGS, IntegrityConfig))
    add_flags(p.add_argument_group("forward-backward disaggregation (MegaFBD)"), (FBD_SWITCH, *FBD_FLAGS), FbdConfig)
    g = p.add_argument_group("MegaDPP dynamic pipeline scheduling (--pipeline-schedule dynamic)")
    add_flags(g, DPP_FLAGS, DppConfig)
    g = p.add_argument_group("MegaDPP rebalancing (any pipeline schedule; dpp/rebalance.py)")
    add_flags(g, REBALANCE_FLAGS, RebalanceConfig)


def _positive(args, names) -> None:
    for n in names:
        v = getattr(args, n, None)
        if v is not None and v < 1:
            raise ConfigError(f"--{n.replace('_', '-')} must be >= 1, got {v}")


def check_flag_combinations(args: argparse.Namespace) -> None:
    """Combinations no config field can refuse on its own; one line each."""
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        raise ConfigError("--recompute-method / --recompute-num-layers need --recompute-granularity full")


def _model_config(args: argparse.Namespace, vocab_size: int | None) -> ModelConfig:
    overrides = {k: getattr(args, k) for k in _MODEL_FLAGS if getattr(args, k, None) is not None}
    overrides.update(compute_query_groups_override(args))
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return model_preset(args.model, **overrides)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _partition(args: argparse.Namespace, model: ModelConfig, pp: int) -> tuple[int, tuple[int, ...]]:
    """Virtual stages per pipeline rank and the layers of each virtual stage (() when split evenly)."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    per_stage = args.pipeline_stage_layers or ()
    if first is None and last is None and not per_stage:
        return _virtual_stages(
            model, pp, args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
        ), ()
    if args.num_layers_per_virtual_pipeline_stage:
        raise ConfigError(
            "--num-layers-per-virtual-pipeline-stage assumes an even split; for an uneven one with virtual "
            "stages give --pipeline-stage-layers with one count per virtual stage"
        )
    vpp = len(per_stage) // pp if per_stage and len(per_stage) > pp and len(per_stage) % pp == 0 else 1
    chunks = args.num_virtual_stages_per_pipeline_rank
    if chunks is not None and chunks != vpp:
        raise ConfigError(
            f"--num-virtual-stages-per-pipeline-rank {chunks} disagrees with the {vpp} virtual stage(s) per "
            "pipeline rank that the stage layer counts give"
        )
    try:
        counts = compute_stage_layers(model.num_layers, pp, vpp, first=first, last=last, per_stage=per_stage)
    except PartitionError as e:
        raise ConfigError(str(e)) from None
    return vpp, counts


def _virtual_stages(model: ModelConfig, pp: int, per: int | None, chunks: int | None = None) -> int:
    """Model chunks per pipeline rank, from layers per chunk or given directly; the layer count
    must divide either way (job.validate_job checks the latter)."""
    if chunks:
        return chunks
    if not per:
        return 1
    if model.num_layers % (pp * per):
        raise ConfigError(
            f"num layers {model.num_layers} is not divisible by pipeline-parallel size {pp} "
            f"x layers per virtual stage {per}"
        )
    return model.num_layers // (pp * per)


def build_fbd_config(args: argparse.Namespace) -> FbdConfig | None:
    """The MegaFBD config of the flags; None without --forward-backward-disaggregating."""
    if not args.forward_backward_disaggregating:
        return None
    return FbdConfig(
        forward_tp_size=args.forward_tensor_model_parallel_size or args.tensor_model_parallel_size,
        **read_flags(args, FBD_FLAGS),
    )


def layout_world_size(args: argparse.Namespace, world: int) -> int:
    """World of the engine's layout: all ranks, or the backward ranks under FBD (checked)."""
    fbd = build_fbd_config(args)
    if fbd is None:
        for flag in ("forward_tensor_model_parallel_size", "forward_device", "inject_crash"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --forward-backward-disaggregating")
        return world
    return build_role_layout(
        world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, fbd
    ).num_backward


def build_job_config(args: argparse.Namespace, world_size: int, vocab_size: int | None = None) -> JobConfig:
    """Translate parsed flags into a JobConfig for `world_size` processes; each config checks its
    own fields, cli/validate.py the job as a whole."""
    _positive(
        args,
        (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage",
            "num_virtual_stages_per_pipeline_rank",
            "nproc_per_node",
            "nnodes",
        ),
    )
    check_flag_combinations(args)
    model = _model_config(args, vocab_size)
    pp = args.pipeline_model_parallel_size
    vpp, stage_layers = _partition(args, model, pp)
    layout = build_layout(layout_world_size(args, world_size), args.tensor_model_parallel_size, pp, vpp, stage_layers)
    schedule = args.pipeline_schedule or ("interleaved" if vpp > 1 else "1f1b")
    return build_job(model, layout, **_given_job_fields(args), schedule=schedule)
